"""The latent-cache offload core: host page allocator (`pages`, numpy only), host latent
pool (`host_pool`), device hot buffer with its slot table and LRU/FIFO resolution
(`hot_buffer`), the two miss-fetch paths (`fetch` in jit, `host_fetch` host-driven), the
model's offloaded latent seam (`latent`) and counters (`metrics`).

May import: jax, numpy, `jlco.offload.*` and `jlco.util` (standard-library helpers);
nothing from the model, engine or planning (the model's cache imports `latent` from
here, not the other way round). Import the submodule you need: this file imports
nothing, so `pages` stays usable without jax.
"""
