"""Pallas kernels, each beside a plain-jnp reference with the same contract: sparse MLA
decode over gathered latent rows (`sparse_mla`, with its Triton GPU body in
`sparse_mla_triton` and Mosaic TPU body in `sparse_mla_tpu`), the lightning indexer's
scores (`indexer`), fp8 latent-row encoding (`fp8_rows`), the one kernel-choice function
(`dispatch`: cuda -> Triton, tpu -> Mosaic, otherwise interpret mode, or plain XLA) and
the tuned block sizes as data (`tuning`).

May import: jax, numpy, `jlco.pallas.*` and `jlco.native` (the XLA:CPU top-k, exactly
`lax.top_k`) only: kernels know nothing of the model, the cache layout or the engine.
"""
