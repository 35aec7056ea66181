"""DeepSeek-V3.2 decode node at 128K context, latent cache offloaded to pinned host memory."""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig

CONFIG = Config(
    name="128k",
    model=ModelConfig(),
    cache=CacheConfig(offload=True, storage="pinned_host", kv_format="fp8",
                      indexer_key_format="fp8", page_size=64, hot_buffer_rows=6400,
                      fetch_chunk_rows=512, prefetch_threads=4, eviction="lru"),
    engine=EngineConfig(max_batch_size=32, max_context_len=131072 + 4096,
                        prefill_chunk=4096, num_draft_tokens=1),
)
