"""GLM-5 / 5.1 (`glm_moe_dsa`, docs/facts.md §6) with the latent cache offloaded, and its
IndexShare form (GLM-5.2 style: most layers reuse the previous full layer's top-k).

GLM-5's real shapes, every layer running its indexer (GLM-5 and 5.1 ship no indexer
pattern); configs/glm5_index_share.py is the same model with layers that share a top-k.

  python -m jlco.plan --config configs/glm5.py --hardware h200
"""
from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig

MODEL = ModelConfig(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, first_k_dense_replace=3,
    num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
    qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=256, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, index_n_heads=32, index_head_dim=128, index_topk=2048,
    rms_norm_eps=1e-5, rope_theta=1e6, rope_scaling=None, max_position_embeddings=202752,
    num_nextn_predict_layers=1)


CONFIG = Config(
    name="glm5",
    model=MODEL,
    cache=CacheConfig(offload=True, kv_format="fp8", indexer_key_format="fp8"),
    engine=EngineConfig(max_batch_size=64, max_context_len=32768, prefill_chunk=2048),
)
