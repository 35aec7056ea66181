"""DeepSeek-V3.2 decode node at 32K context, latent cache offloaded to pinned host memory.

Per-GPU batch 128 and a 6.4K-row hot buffer follow ESS's 32K operating points (docs/facts.md §3);
MTP with 1 draft token (s_q = 2).
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig

CONFIG = Config(
    name="32k",
    model=ModelConfig(),
    cache=CacheConfig(offload=True, storage="pinned_host", kv_format="fp8",
                      indexer_key_format="fp8", page_size=64, hot_buffer_rows=6400,
                      fetch_chunk_rows=512, prefetch_threads=4, eviction="lru"),
    engine=EngineConfig(max_batch_size=128, max_context_len=32768 + 4096,
                        prefill_chunk=2048, num_draft_tokens=1),
)
