"""transformers' DeepseekV32 (or GlmMoeDsa, for model_type glm_moe_dsa) as the independent
reference: random checkpoints and runs.

Parity tests and `tools/parity_long.py` both need it, and tools must not import the
tests, so it lives here. It imports torch and transformers (the `test` extra) only when
called; nothing in the serving path imports this module.

- `build_hf_model` makes a fp32 `DeepseekV32ForCausalLM` (`GlmMoeDsaForCausalLM` for a
  glm_moe_dsa config: its indexer_types, mlp_layer_types, rms_norm_eps) mirroring a jlco
  ModelConfig;
  `hf_tensors` saves it with `save_pretrained` (tensor names exactly the checkpoint's)
  and reads the safetensors back for `jlco.checkpoint.hf_names.model_from_hf`.
- `hf_greedy_chunked` runs it as a long-context user would: the prompt fed in chunks
  through its own cache (a full [T, T] recompute at 16K needs ~8 GB per layer), then
  greedy decode steps, with each layer's indexer top-k set and score row of the last
  query recorded through forward hooks on its indexer modules.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time

import numpy as np

from jlco.config import ModelConfig, RopeScaling


def long_context_model() -> ModelConfig:
    """The long-context parity model of issue 26: vocab 2048, hidden 512, 4 layers (1
    dense), 8 MLA heads, kv_lora 512, rope 64, nope 128, v 128, q_lora 256, 16 routed
    experts top-2, 16 index heads x 128, index_topk 256, f32; the released model's YaRN
    (factor 40 over 4096, so 128K positions are in range)."""
    return ModelConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
        q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=16,
        index_head_dim=128, index_topk=256, rope_scaling=RopeScaling(),
        max_position_embeddings=163840, num_nextn_predict_layers=0, dtype="float32")


def hf_config(cfg: ModelConfig, **overrides):
    from transformers import DeepseekV32Config, GlmMoeDsaConfig
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
        tie_word_embeddings=cfg.tie_word_embeddings,
        mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense"
                         for i in range(cfg.num_hidden_layers)])
    if cfg.model_type == "glm_moe_dsa":
        kw["indexer_types"] = ["shared" if cfg.shares_topk(i) else "full"
                               for i in range(cfg.num_hidden_layers)]
    kw.update(overrides)
    return (GlmMoeDsaConfig if cfg.model_type == "glm_moe_dsa" else DeepseekV32Config)(**kw)


def build_hf_model(cfg: ModelConfig, seed: int = 0, init_std: float = 0.02,
                   bias_std: float = 0.0):
    """Random fp32 reference model. `init_std` larger than transformers' 0.02 makes
    logits and indexer scores less flat, so greedy tokens and top-k sets are decisive;
    `bias_std` gives the router's e_score_correction_bias nonzero values to exercise it."""
    import torch
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM
    torch.manual_seed(seed)
    cls = GlmMoeDsaForCausalLM if cfg.model_type == "glm_moe_dsa" else DeepseekV32ForCausalLM
    model = cls(hf_config(cfg, initializer_range=init_std))
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:   # norms: not all ones, so a dropped weight shows
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(bias_std * torch.randn_like(buf))
    return model


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The checkpoint-format tensors (per-expert names) as numpy, via save_pretrained."""
    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        out: dict[str, np.ndarray] = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
    return out


def _last_query_scores(indexer, args, cache):
    """The indexer's score row [T] of the call's last query, as transformers computes it
    (f32), and the same row in float64 from the same f32 q, k and weights."""
    import torch
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf
    hidden, q_resid, (cos, sin) = args[0][:, -1:], args[1][:, -1:], args[2]
    r, h, d = indexer.qk_rope_head_dim, indexer.n_heads, indexer.head_dim
    q = indexer.wq_b(q_resid).view(1, 1, h, d)
    q_rot, q_pass = torch.split(q, [r, d - r], dim=-1)
    q_rot, _ = hf.apply_rotary_pos_emb(q_rot, q_rot, cos[:, -1:], sin[:, -1:], unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)                                # [1, 1, H, D]
    keys = cache.layers[indexer.layer_idx].indexer_keys                   # [1, T, D]
    w = indexer.weights_proj(hidden).float() * (h ** -0.5)                # [1, 1, H]
    out = []
    for dt in (torch.float32, torch.float64):
        s = torch.relu(torch.matmul(q.to(dt), keys.transpose(-1, -2).to(dt).unsqueeze(1))
                       * indexer.softmax_scale)                           # [1, 1, H, T]
        out.append(torch.matmul(w.to(dt).unsqueeze(-2), s).reshape(-1).numpy())
    return out


def _indexer_hooks(model, record: dict):
    """Forward hooks on every layer's indexer: every query's top-k set (the indices its
    forward returned, sorted) into record["sets"][layer]; while record["on"], the last
    query's set and score rows into record["layers"][layer]."""
    handles = []
    for layer in model.model.layers:
        idx = layer.self_attn.indexer
        if idx is None:                  # a GLM layer that shares the previous top-k
            continue

        def hook(m, args, kwargs, output, idx=idx):
            sets = np.sort(output[0].numpy(), axis=-1).astype(np.int32)     # [s, k]
            if sets.shape[-1] < m.index_topk:      # fewer keys than k: every key (-1 rows)
                sets = np.full((sets.shape[0], m.index_topk), -1, np.int32)
            record["sets"].setdefault(m.layer_idx, []).append(sets)
            if record["on"]:
                f32, f64 = _last_query_scores(m, args, kwargs["cache"])
                record["layers"][m.layer_idx] = dict(
                    topk=np.sort(output[0, -1].numpy()).astype(np.int32), scores=f32,
                    scores64=f64)
        handles.append(idx.register_forward_hook(hook, with_kwargs=True))
    return handles


def _step_record(logits, record: dict) -> dict:
    """One step's greedy token, its log-softmax row and the per-layer indexer records."""
    import torch
    logp = torch.log_softmax(logits[0, -1].double(), -1).numpy()
    top2 = np.sort(logits[0, -1].numpy())[-2:]
    layers = [record["layers"][i] for i in sorted(record["layers"])]
    return dict(token=int(np.argmax(logp)), logp=logp.astype(np.float32),
                margin=float(top2[1] - top2[0]), layers=layers)


def hf_greedy_chunked(model, prompt, steps: int, chunk: int = 128, progress=None,
                      record_indexer: bool = True) -> list[dict]:
    """Greedy run of `model` on `prompt` (1-D ints): prefill in `chunk`-token pieces
    through one DynamicCache, then `steps` - 1 decode steps → `steps` records (step 0
    is the prefill's last position): token, log-softmax [V] (float64 computed),
    top-2 logit margin, and per layer the indexer's top-k set and score rows; step 0
    also has "prompt_sets": per layer every prompt query's top-k set [n, k] (sorted;
    -1 rows for the chunks with fewer than k keys, where every key is selected)."""
    import torch
    from transformers import DynamicCache
    ids = torch.tensor(np.asarray(prompt, np.int64)[None])
    cache = DynamicCache(config=model.config)
    record = {"on": False, "layers": {}, "sets": {}}
    handles = _indexer_hooks(model, record) if record_indexer else []
    out, t0 = [], time.perf_counter()
    try:
        with torch.no_grad():
            n = ids.shape[1]
            for lo in range(0, n, chunk):
                record["on"] = record_indexer and lo + chunk >= n
                res = model(ids[:, lo:lo + chunk], cache=cache, use_cache=True,
                            logits_to_keep=1)
                if progress:
                    progress(f"transformers prefill {min(lo + chunk, n)}/{n} "
                             f"({time.perf_counter() - t0:.0f} s)")
            out.append(_step_record(res.logits, record))
            out[0]["prompt_sets"] = [np.concatenate(record["sets"][i], axis=0)
                                     for i in sorted(record["sets"])] if record_indexer else []
            for _ in range(steps - 1):
                tok = torch.tensor([[out[-1]["token"]]])
                res = model(tok, cache=cache, use_cache=True)
                out.append(_step_record(res.logits, record))
    finally:
        for h in handles:
            h.remove()
    return out


def layer0_index_scores64(model, prompt, queries) -> list[np.ndarray]:
    """Layer 0's indexer scores [t + 1] of prompt queries t, in float64 from the model's
    f32 weights. Layer 0's inputs are the token embeddings, so both engines score the
    same q and k up to rounding: where their top-k sets differ there, these rows show
    whether the k-th and (k+1)-th scores tie within f32 rounding."""
    import torch
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf
    layer = model.model.layers[0]
    attn, idx = layer.self_attn, layer.self_attn.indexer
    r, h, d = idx.qk_rope_head_dim, idx.n_heads, idx.head_dim
    ids = torch.tensor(np.asarray(prompt[:max(queries) + 1], np.int64)[None])
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(ids))
        cos, sin = model.model.rotary_emb(x, torch.arange(ids.shape[1])[None])
        q = idx.wq_b(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, -1, h, d)
        k = idx.k_norm(idx.wk(x)).unsqueeze(2)
        q_rot, k_rot = hf.apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q[..., r:]], -1)[0].double()                  # [T, H, D]
        k = torch.cat([k_rot, k[..., r:]], -1)[0, :, 0].double()            # [T, D]
        w = idx.weights_proj(x)[0].double() * h ** -0.5                     # [T, H]
        return [(torch.relu(q[t] @ k[:t + 1].T * idx.softmax_scale) * w[t][:, None]
                 ).sum(0).numpy() for t in queries]


# ----------------------------------------------------------------------------- DeepSeek-V4

# A tiny DeepseekV4Config with every feature: the three attention kinds (CSA twice, so
# its two compressors and indexer meet the overlap carry), hash and routed MoE layers,
# a window of 8, CSA rate 4 with index_topk 3 (a 40-token prompt has 10 entries) and HCA
# rate 8. 16 index heads: a score is exactly 0 when every head's ReLU is (2^-16 of the
# pairs), and a tie at 0 across the top-k cut is broken differently by torch.topk and
# lax.top_k (both valid picks); with 8 heads one in the 40-token test prompt did.
V4_TINY = dict(
    vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, head_dim=16, qk_rope_head_dim=4, q_lora_rank=24, o_groups=2,
    o_lora_rank=8, sliding_window=8,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"], index_n_heads=16,
    index_head_dim=8, index_topk=3, n_routed_experts=4, num_experts_per_tok=2, hc_mult=4,
    hc_sinkhorn_iters=20, swiglu_limit=1.0)


def build_hf_v4_model(seed: int = 0, std: float = 0.15, **overrides):
    """Random fp32 DeepseekV4ForCausalLM from V4_TINY (| overrides). transformers
    initialises norms to one, biases, sinks, position biases and hyper-connection bases
    to zero and the hash table to expert 0: all are redrawn (vectors around their init
    with std 0.5, matrices N(0, std), each hash row k distinct experts), so a dropped
    or misplaced term shows in the logits. swiglu_limit 1 makes the clamps bite."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**(V4_TINY | overrides))).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                e = model.config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(e, generator=g)[:p.shape[1]]
                                     for _ in range(p.shape[0])]))
            elif p.ndim == 1 or "position_bias" in name:
                one = "norm" in name or name.endswith("scale")
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + float(one))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model
