"""DeepSeek-V4 (`model_type` deepseek_v4): its architecture config, the Flax model
(sliding-window, compressed-sparse and heavily-compressed attention, hyper-connections,
hash / routed MoE) and the per-request decode state (window ring, compressor carry,
compressed entries). docs/facts.md §7 records what transformers' DeepseekV4ForCausalLM,
the reference these modules are checked against, computes."""
