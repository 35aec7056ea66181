"""Hugging Face tensor names ↔ the NNX model: the one place that knows both layouts.

Names are exactly those `transformers`' DeepseekV32 writes with `save_pretrained` (and the
released checkpoint uses): torch `[out, in]` linears, routed experts one tensor per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`), plus the MTP layer `model.layers.{L}.*`
(L = num_hidden_layers) with enorm, hnorm, eh_proj, shared_head.{norm,head} and its block.
The released checkpoint also repeats the embedding as `model.layers.{L}.embed_tokens.weight`;
it is accepted and ignored (the MTP layer shares the main embedding). GLM-5
(`GlmMoeDsaForCausalLM`) writes the same names; a layer that shares its top-k
(`indexer_types` "shared") has no `self_attn.indexer.*` tensors.
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import ModelConfig
from jlco.model.decoder import DeepseekV32

# (hf suffix, our path suffix, transpose) for one decoder block.
_ATTN = [("q_a_proj.weight", ("q_a_proj", "weight"), True),
         ("q_a_layernorm.weight", ("q_a_layernorm", "weight"), False),
         ("q_b_proj.weight", ("q_b_proj", "weight"), True),
         ("kv_a_proj_with_mqa.weight", ("kv_a_proj_with_mqa", "weight"), True),
         ("kv_a_layernorm.weight", ("kv_a_layernorm", "weight"), False),
         ("kv_b_proj.weight", ("kv_b_proj", "w_uk"), ("heads", "nope")),
         ("kv_b_proj.weight", ("kv_b_proj", "w_uv"), ("heads", "value")),
         ("o_proj.weight", ("o_proj", "weight"), True),
         ("indexer.wq_b.weight", ("indexer", "wq_b", "weight"), True),
         ("indexer.wk.weight", ("indexer", "wk", "weight"), True),
         ("indexer.k_norm.weight", ("indexer", "k_norm", "weight"), False),
         ("indexer.k_norm.bias", ("indexer", "k_norm", "bias"), False),
         ("indexer.weights_proj.weight", ("indexer", "weights_proj", "weight"), True)]
_MLP = [(f"{p}.weight", (p, "weight"), True) for p in ("gate_proj", "up_proj", "down_proj")]
_OPTIONAL_MTP = "embed_tokens.weight"


def _block_entries(cfg: ModelConfig, hf: str, ours: tuple, moe: bool, shared: bool = False):
    """Yield (hf name, torch shape, our path, transform) for one decoder block.
    transform: True = transpose, False = as is, ("expert", e) = row e of a stacked tensor,
    ("heads", half) = the nope / value half of kv_b_proj as [h, n or v, c]."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    attn_shapes = {
        "q_a_proj.weight": (cfg.q_lora_rank, d), "q_a_layernorm.weight": (cfg.q_lora_rank,),
        "q_b_proj.weight": (h * cfg.qk_head_dim, cfg.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (cfg.latent_dim, d),
        "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "kv_b_proj.weight": (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "o_proj.weight": (d, h * cfg.v_head_dim),
        "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk.weight": (cfg.index_head_dim, d),
        "indexer.k_norm.weight": (cfg.index_head_dim,), "indexer.k_norm.bias": (cfg.index_head_dim,),
        "indexer.weights_proj.weight": (cfg.index_n_heads, d)}
    for name, path, t in _ATTN:
        if shared and name.startswith("indexer."):
            continue
        yield f"{hf}.self_attn.{name}", attn_shapes[name], ours + ("self_attn",) + path, t
    for norm in ("input_layernorm", "post_attention_layernorm"):
        yield f"{hf}.{norm}.weight", (d,), ours + (norm, "weight"), False
    if not moe:
        shapes = {"gate_proj": (cfg.intermediate_size, d), "up_proj": (cfg.intermediate_size, d),
                  "down_proj": (d, cfg.intermediate_size)}
        for name, path, t in _MLP:
            yield f"{hf}.mlp.{name}", shapes[path[0]], ours + ("mlp",) + path, t
        return
    i, e_n = cfg.moe_intermediate_size, cfg.n_routed_experts
    yield f"{hf}.mlp.gate.weight", (e_n, d), ours + ("mlp", "gate", "weight"), True
    yield (f"{hf}.mlp.gate.e_score_correction_bias", (e_n,),
           ours + ("mlp", "gate", "e_score_correction_bias"), False)
    for e in range(e_n):
        for name, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            yield (f"{hf}.mlp.experts.{e}.{name}.weight", shape,
                   ours + ("mlp", "experts", name), ("expert", e))
    if cfg.n_shared_experts:
        si = i * cfg.n_shared_experts
        shapes = {"gate_proj": (si, d), "up_proj": (si, d), "down_proj": (d, si)}
        for name, path, t in _MLP:
            yield (f"{hf}.mlp.shared_experts.{name}", shapes[path[0]],
                   ours + ("mlp", "shared_experts") + path, t)


def _entries(cfg: ModelConfig, mtp: bool):
    d, v = cfg.hidden_size, cfg.vocab_size
    yield "model.embed_tokens.weight", (v, d), ("embed_tokens",), False
    for n in range(cfg.num_hidden_layers):
        yield from _block_entries(cfg, f"model.layers.{n}", ("layers", n), cfg.is_moe_layer(n),
                                  cfg.shares_topk(n))
    yield "model.norm.weight", (d,), ("norm", "weight"), False
    yield "lm_head.weight", (v, d), ("lm_head", "weight"), True
    if mtp:
        p = f"model.layers.{cfg.num_hidden_layers}"
        yield f"{p}.enorm.weight", (d,), ("mtp", "enorm", "weight"), False
        yield f"{p}.hnorm.weight", (d,), ("mtp", "hnorm", "weight"), False
        yield f"{p}.eh_proj.weight", (d, 2 * d), ("mtp", "eh_proj", "weight"), True
        yield f"{p}.shared_head.norm.weight", (d,), ("mtp", "shared_head", "norm", "weight"), False
        yield f"{p}.shared_head.head.weight", (v, d), ("mtp", "shared_head", "head", "weight"), True
        yield from _block_entries(cfg, p, ("mtp", "block"), True)


def _check_mtp(cfg: ModelConfig, mtp: bool) -> None:
    if mtp and cfg.num_nextn_predict_layers != 1:
        raise ValueError("mtp=True needs model.num_nextn_predict_layers=1 "
                         f"(got {cfg.num_nextn_predict_layers})")


def hf_tensor_names(cfg: ModelConfig, mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor name the loader must provide → its torch-layout shape."""
    _check_mtp(cfg, mtp)
    return {name: shape for name, shape, _, _ in _entries(cfg, mtp)}


def param_sources(cfg: ModelConfig, mtp: bool) -> dict[tuple, tuple[object, tuple[str, ...]]]:
    """Each model parameter path → (transform, HF tensor names it is built from): one name
    for True (transpose) / False (as is) / ("heads", half); one name per expert, in expert
    order, for "expert" (a stacked [E, in, out] parameter). The streaming loader builds
    each parameter (or any slice of it) from this without the other tensors."""
    _check_mtp(cfg, mtp)
    if not mtp and cfg.num_nextn_predict_layers:
        cfg = _without_mtp(cfg)
    out: dict[tuple, tuple[object, tuple[str, ...]]] = {}
    for name, _, path, how in _entries(cfg, mtp):
        if isinstance(how, tuple) and how[0] == "expert":
            out[path] = ("expert", out.get(path, (None, ()))[1] + (name,))
        else:
            out[path] = (how, (name,))
    return out


def _validate(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], mtp: bool):
    entries = list(_entries(cfg, mtp))
    known = {e[0] for e in entries}
    optional = {f"model.layers.{cfg.num_hidden_layers}.{_OPTIONAL_MTP}"} if mtp else set()
    missing = sorted(known - tensors.keys())
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unknown = sorted(tensors.keys() - known - optional)
    if unknown:
        raise ValueError(f"unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all; "
                         f"mtp={mtp})")
    for name, shape, _, _ in entries:
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape}")
    return entries


def model_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], *,
                  mtp: bool) -> DeepseekV32:
    """Build the model from HF-named numpy tensors (validated first; nothing random is
    materialised: the tree is created abstractly and every leaf is replaced)."""
    _check_mtp(cfg, mtp)
    if not mtp and cfg.num_nextn_predict_layers:
        cfg = _without_mtp(cfg)
    entries = _validate(cfg, tensors, mtp)
    abstract = nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    stacks: dict[tuple, list] = {}
    values: dict[tuple, np.ndarray] = {}
    h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    for name, _, path, how in entries:
        arr = np.asarray(tensors[name])
        if isinstance(how, tuple) and how[0] == "heads":
            per_head = arr.reshape(h, -1, arr.shape[-1])          # [h, n+v, c]
            values[path] = per_head[:, :nope] if how[1] == "nope" else per_head[:, nope:]
        elif isinstance(how, tuple):
            stacks.setdefault(path, []).append(arr.T)
        else:
            values[path] = arr.T if how else arr
    for path, rows in stacks.items():
        values[path] = np.stack(rows)
    for path, var in flat.items():
        if path not in values:
            raise ValueError(f"internal: parameter {'.'.join(map(str, path))} has no HF tensor")
        want = var.get_value()
        arr = values[path]
        if arr.shape != tuple(want.shape):
            raise ValueError(f"internal: {'.'.join(map(str, path))} got {arr.shape}, "
                             f"want {want.shape}")
        var.set_value(jnp.asarray(arr, dtype=want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _without_mtp(cfg: ModelConfig) -> ModelConfig:
    import dataclasses
    return dataclasses.replace(cfg, num_nextn_predict_layers=0)
