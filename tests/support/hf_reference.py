"""transformers' DeepseekV32 as the independent reference for parity tests.

Builds a fp32 `DeepseekV32ForCausalLM` mirroring a jlco ModelConfig, saves it with
`save_pretrained` (so tensor names are exactly the checkpoint's: per-expert weights) and
reads the safetensors back as numpy for `jlco.checkpoint.hf_names.model_from_hf`.
"""

from __future__ import annotations

import glob
import os
import tempfile

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

from jlco.config import ModelConfig


def hf_config(cfg: ModelConfig, **overrides) -> DeepseekV32Config:
    rs = cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if rs is not None:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
                "mscale_all_dim": rs.mscale_all_dim}
    kw = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, first_k_dense_replace=cfg.first_k_dense_replace,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        tie_word_embeddings=cfg.tie_word_embeddings)
    kw.update(overrides)
    return DeepseekV32Config(**kw)


def build_hf_model(cfg: ModelConfig, seed: int = 0, init_std: float = 0.02,
                   bias_std: float = 0.0) -> DeepseekV32ForCausalLM:
    """Random fp32 reference model. `init_std` larger than transformers' 0.02 makes
    logits and indexer scores less flat, so greedy tokens and top-k sets are decisive;
    `bias_std` gives the router's e_score_correction_bias nonzero values to exercise it."""
    torch.manual_seed(seed)
    model = DeepseekV32ForCausalLM(hf_config(cfg, initializer_range=init_std))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:   # norms: not all ones, so a dropped weight shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(bias_std * torch.randn_like(buf))
    return model


def hf_tensors(model: DeepseekV32ForCausalLM) -> dict[str, np.ndarray]:
    """The checkpoint-format tensors (per-expert names) as numpy, via save_pretrained."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, np.ndarray] = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
    return out


def capture(module: torch.nn.Module, store: dict, key: str):
    """Forward hook storing (args, kwargs, output) of `module` under store[key]."""
    def hook(_m, args, kwargs, output):
        store[key] = (args, kwargs, output)
    return module.register_forward_hook(hook, with_kwargs=True)


def t2n(x) -> np.ndarray:
    return x.detach().float().cpu().numpy()
