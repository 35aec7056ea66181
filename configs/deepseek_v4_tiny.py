"""A tiny random-weight DeepSeek-V4 model for tests and CPU demos (seconds to compile):
`python -m jlco.generate --config configs/deepseek_v4_tiny.py --random_prompt 64` and
`python -m jlco.serve --config configs/deepseek_v4_tiny.py`, no checkpoint.

Every layer type (sliding window, CSA, HCA) and both MoE kinds (hash-routed by token id,
score-routed). A few hundred tokens exercise all of them: the 32-token window is passed
at 33 tokens, HCA pools 16 tokens per entry, and CSA's indexer picks 8 of its entries
(one per 4 tokens) once there are more (36 tokens on). vocab 512 holds the servers'
byte-level tokenizer (257 ids).
"""
from jlco.config import CacheConfig, Config, EngineConfig
from jlco.model.deepseek_v4.config import V4Config

MODEL = V4Config(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=48, o_groups=2,
    o_lora_rank=16, sliding_window=32,
    layer_types=("sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"),
    compress_rate_csa=4, compress_rate_hca=16,
    mlp_layer_types=("hash_moe", "moe", "moe", "moe"),
    index_n_heads=8, index_head_dim=16, index_topk=8, n_routed_experts=8,
    num_experts_per_tok=2, hc_mult=4, max_position_embeddings=2048, dtype="float32",
)

CONFIG = Config(
    name="deepseek_v4_tiny",
    model=MODEL,
    cache=CacheConfig(offload=False, prefix_cache=False),
    engine=EngineConfig(max_batch_size=4, max_context_len=512, prefill_chunk=64),
)
