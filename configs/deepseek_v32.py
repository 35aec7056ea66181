"""The real DeepSeek-V3.2 model (docs/facts.md §1) with the on-device cache (offload off)."""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig

CONFIG = Config(
    name="deepseek_v32",
    model=ModelConfig(),  # defaults are the official config_671B_v3.2.json values
    cache=CacheConfig(offload=False, kv_format="fp8", indexer_key_format="fp8"),
    engine=EngineConfig(max_batch_size=16, max_context_len=32768, prefill_chunk=2048),
)
