"""A tiny random-weight model for tests and CPU demos (seconds to compile).

16 index heads: with ~4, ReLU zeroes every head for some tokens and top-k ties at 0
(docs/facts.md §1). index_topk 32 < typical test prompts, so the sparsity really selects.
kv_lora_rank 128 keeps the fp8 row layout (one scale per 128 values) valid.
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig, RopeScaling

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
    q_lora_rank=48, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=16,
    index_head_dim=32, index_topk=32, rope_scaling=RopeScaling(
        factor=4.0, original_max_position_embeddings=256), max_position_embeddings=2048,
    dtype="float32",
)

CONFIG = Config(
    name="tiny",
    model=MODEL,
    cache=CacheConfig(offload=False, kv_format="f32", page_size=16),
    engine=EngineConfig(max_batch_size=4, max_context_len=512, prefill_chunk=64),
)
