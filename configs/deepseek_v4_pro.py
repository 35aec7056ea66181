"""DeepSeek-V4-Pro (1.6 T parameters, 49 B active; 61 layers + 1 MTP) at 128K context with
its CSA entries offloaded to host memory: a plan for `python -m jlco.plan` (the V4 memory
plan). Shapes from the published model card (docs/facts.md §7: hidden 7168, 128 heads of
512, q_lora_rank 1536, 16 output groups of rank 1024, 384 routed experts of 3072 + 1
shared, 6 per token, top-1024 CSA entries, layers 0-1 HCA then CSA / HCA alternating);
the indexer's heads (64 x 128) are Flash's, not published for Pro."""
from jlco.model.deepseek_v4.config import V4Config
from jlco.planning.v4 import V4Deployment

MODEL = V4Config(hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                 q_lora_rank=1536, o_groups=16, o_lora_rank=1024, n_routed_experts=384,
                 moe_intermediate_size=3072, index_topk=1024)
DEPLOYMENT = V4Deployment(name="deepseek_v4_pro", model=MODEL, max_context_len=131072,
                          max_batch_size=256, num_draft_tokens=1)
