# Sourced by tools/device_check.sh and tools/device_offload_probe.sh: the real DeepSeek-V3.2
# head shapes (one decoder layer's worth; layers and top-k are flags) as config overrides.
REAL_HEADS="model__hidden_size=7168,model__q_lora_rank=1536,model__num_attention_heads=128"
REAL_HEADS+=",model__qk_nope_head_dim=128,model__v_head_dim=128,model__kv_lora_rank=512"
REAL_HEADS+=",model__qk_rope_head_dim=64,model__index_n_heads=64,model__index_head_dim=128"
REAL_HEADS+=",cache__kv_format=fp8,cache__indexer_key_format=fp8"
