"""Checkpoints: Hugging Face safetensors (single or sharded; bf16 / f16 / f32 / fp8 e4m3
with block scales) read by our own header parser (`safetensors_io`), HF tensor names
mapped onto the model (`hf_names`), and loading / Orbax saving with a dtype manifest
(`load`).

May import: jax, flax, orbax, numpy, `jlco.config`, `jlco.model`. Never the engine or
planning.
"""
