"""Checkpoints: Hugging Face safetensors (single or sharded; bf16 / f16 / f32 / fp8 e4m3
with block scales) read by our own header parser (`safetensors_io`), HF tensor names
mapped onto the model (`hf_names`), streamed onto devices slice by slice (`stream`), and
loading / Orbax saving with a manifest of leaf dtypes and sha256 checksums (`load`).

May import: jax, flax, orbax, numpy, `jlco.config`, `jlco.model`, `jlco.util`
(standard-library helpers). Never the engine or planning.
"""
