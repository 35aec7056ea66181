"""A small random-weight model for the CPU decode benchmark (tools/bench_decode.py).

Shapes follow DeepSeek-V3.2 where the per-token cache bytes are decided (kv_lora_rank
512 + rope 64 → 656-byte fp8 rows; fp8 indexer keys of 128 dims → 132 B), and shrink
what only costs CPU time (2 layers, hidden 256, 8 MLA heads, 8 index heads, top-k 1024).
Per request and layer at 128K: latent 86 MB, indexer keys 17 MB, hot buffer
(2 × top-k rows) 1.3 MB. No MTP layer, so the planner and the cache count the same layers.

The bench overrides batch, context, top-k, layers and offload per run; these are the
defaults it starts from.
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig, RopeScaling

MODEL = ModelConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=8,
    q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=64, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=8,
    index_head_dim=128, index_topk=1024,
    rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096),
    max_position_embeddings=163840, num_nextn_predict_layers=0, dtype="bfloat16",
)

CONFIG = Config(
    name="bench_small",
    model=MODEL,
    cache=CacheConfig(offload=True, storage="pinned_host", kv_format="fp8",
                      indexer_key_format="fp8", page_size=64, hot_buffer_rows=2048,
                      fetch_chunk_rows=256, eviction="lru"),
    engine=EngineConfig(max_batch_size=4, max_context_len=32768 + 64, prefill_chunk=512,
                        attention_impl="xla"),
)
