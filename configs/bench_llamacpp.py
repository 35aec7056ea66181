"""The checkpoint shape of the CPU comparison with llama.cpp (tools/bench_vs_llamacpp.py):
vocab 2048, hidden 512, 4 layers (the first dense), 8 MLA heads, kv_lora_rank 512, rope
64, nope 128, v 128, q_lora 256, 16 routed experts top-2 + 1 shared, index 16 heads of
128, top-k 256, float32: 35.7 M parameters, ~18 M active per token. No YaRN and one expert
group, so both engines compute the same function without depending on how each maps the
rope-scaling and group-routing keys. The engine section is overridden per run.
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig

MODEL = ModelConfig(
    vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
    q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, index_n_heads=16,
    index_head_dim=128, index_topk=256, rope_scaling=None, max_position_embeddings=65536,
    num_nextn_predict_layers=0, dtype="float32",
)

CONFIG = Config(
    name="bench_llamacpp",
    model=MODEL,
    cache=CacheConfig(offload=False, kv_format="f32", page_size=64),
    engine=EngineConfig(max_batch_size=4, max_context_len=33024, prefill_chunk=512),
)
