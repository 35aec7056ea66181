"""DeepSeek-V4-Flash (284 B parameters, 13 B active; 43 layers) at 128K context with its
CSA entries offloaded to host memory: a plan for `python -m jlco.plan` (the V4 memory
plan). The architecture is transformers' DeepseekV4Config defaults, documented as
DeepSeek-V4-Flash's (docs/facts.md §7)."""
from jlco.model.deepseek_v4.config import V4Config
from jlco.planning.v4 import V4Deployment

DEPLOYMENT = V4Deployment(name="deepseek_v4_flash", model=V4Config(),
                          max_context_len=131072, max_batch_size=256, num_draft_tokens=1)
