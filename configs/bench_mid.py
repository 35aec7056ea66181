"""A mid-size random-weight model for CPU performance work: the shape the decode-cost
issue measured (hidden 512, 4 layers, 8 MLA heads, kv_lora_rank 512, 16 routed experts,
16 index heads of 128, top-k 256, float32; ~50 M parameters, ~27 M active per token).
`tools/profile_step.py` and `tools/bench_vs_transformers.py` start from it; the engine
section is overridden per run (batch, context).
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig, RopeScaling

MODEL = ModelConfig(
    vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
    q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=16,
    index_head_dim=128, index_topk=256, rope_scaling=RopeScaling(
        factor=4.0, original_max_position_embeddings=4096), max_position_embeddings=65536,
    num_nextn_predict_layers=0, dtype="float32",
)

CONFIG = Config(
    name="bench_mid",
    model=MODEL,
    cache=CacheConfig(offload=False, kv_format="f32", page_size=64),
    engine=EngineConfig(max_batch_size=4, max_context_len=8256, prefill_chunk=512),
)
