"""DeepSeek-V3.2 in Flax NNX: the decoder (`decoder.DeepseekV32`, dense and MoE layers,
MTP layer), MLA with absorbed decode (`mla`), the lightning indexer (`indexer`), MoE
(`moe`), shared layers and RoPE (`layers`), the kernel entry points (`attention`, which
dispatches to `jlco.pallas`), the device decode cache with its two latent seams
(`kv_cache`), fp8 emulation (`fp8_emul`) and chunked prefill with its split-state
helpers: logits head, MTP draft step, sampling (`prefill`).

May import: jax, flax, `jlco.config`, `jlco.pallas`, `jlco.offload` (the offloaded latent
seam), `jlco.parallel` (the expert-parallel MoE under a mesh; the mesh package sits
below the model, so the cache's own split over data ranks, `kv_cache.data_specs`,
lives here) and `jlco.util`. Never the engine, checkpoints or planning.
"""
