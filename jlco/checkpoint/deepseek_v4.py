"""DeepSeek-V4 checkpoints (`model_type` deepseek_v4): tensor names ↔ the NNX model, and
the loader (single file or shards; f32 / bf16).

Names are DeepSeek's, as `transformers`' DeepseekV4ForCausalLM writes them with
`save_pretrained` (`model.` prefix, embed / norm / hc_head under HF names, `head.weight`
unprefixed) and as its conversion accepts them unprefixed (`embed.weight`,
`hc_head_fn`, `layers.N.…`): both spellings load (docs/facts.md §7). Routed experts
are one tensor per expert (`ffn.experts.E.w1/w2/w3`), stacked here. MTP tensors
(`mtp.*`) are ignored, as transformers ignores them. fp8 / fp4 block-quantised weights
(`X.weight` + `X.scale`) are dequantised to f32 as they are read
(`jlco.checkpoint.deepseek_v4_quant`). Every tensor is read whole into host memory
(no streaming, no mesh placement yet): fine for test-sized and mid-sized checkpoints.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.checkpoint import deepseek_v4_quant as quant
from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.safetensors_io import CheckpointError
from jlco.config import ConfigError
from jlco.model.deepseek_v4.config import CSA, HCA, V4Config
from jlco.model.deepseek_v4.model import DeepseekV4

_IGNORED = (re.compile(r"mtp\..*"),)
_TOP_RENAMES = {"embed.weight": "embed_tokens.weight", "hc_head_fn": "hc_head.hc_fn",
                "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_INT_DTYPES = {"I64": np.int64, "I32": np.int32}


def canonical_name(name: str) -> str:
    """One spelling per tensor: without `model.`, embed / hc_head under HF's names."""
    name = name.removeprefix("model.")
    return _TOP_RENAMES.get(name, name)


def _linear(hf: str, out: int, inp: int, path: tuple):
    return hf, (out, inp), path, "T"


def _compressor(p: str, ours: tuple, width: int, rate: int, d: int, overlap: bool):
    w = 2 * width if overlap else width
    yield _linear(f"{p}.wkv.weight", w, d, ours + ("wkv", "weight"))
    yield _linear(f"{p}.wgate.weight", w, d, ours + ("wgate", "weight"))
    yield f"{p}.ape", (rate, w), ours + ("ape",), None
    yield f"{p}.norm.weight", (width,), ours + ("norm", "weight"), None


def _attention(cfg: V4Config, p: str, ours: tuple, kind: str):
    d, h, dh, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    g = cfg.o_groups
    yield _linear(f"{p}.wq_a.weight", q, d, ours + ("wq_a", "weight"))
    yield f"{p}.q_norm.weight", (q,), ours + ("q_norm", "weight"), None
    yield _linear(f"{p}.wq_b.weight", h * dh, q, ours + ("wq_b", "weight"))
    yield _linear(f"{p}.wkv.weight", dh, d, ours + ("wkv", "weight"))
    yield f"{p}.norm.weight", (dh,), ours + ("norm", "weight"), None
    yield f"{p}.wo_a.weight", (g * cfg.o_lora_rank, h * dh // g), ours + ("wo_a",), "groups"
    yield _linear(f"{p}.wo_b.weight", d, g * cfg.o_lora_rank, ours + ("wo_b", "weight"))
    yield f"{p}.attn_sink", (h,), ours + ("attn_sink",), None
    if kind == HCA:
        yield from _compressor(f"{p}.compressor", ours + ("compressor",), dh,
                               cfg.compress_rate_hca, d, False)
    elif kind == CSA:
        m, hi, di = cfg.compress_rate_csa, cfg.index_n_heads, cfg.index_head_dim
        yield from _compressor(f"{p}.compressor", ours + ("compressor",), dh, m, d, True)
        yield from _compressor(f"{p}.indexer.compressor", ours + ("indexer", "compressor"),
                               di, m, d, True)
        yield _linear(f"{p}.indexer.wq_b.weight", hi * di, q, ours + ("indexer", "wq_b", "weight"))
        yield _linear(f"{p}.indexer.weights_proj.weight", hi, d,
                      ours + ("indexer", "weights_proj", "weight"))


def _ffn(cfg: V4Config, p: str, ours: tuple, hashed: bool):
    d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    yield _linear(f"{p}.gate.weight", e, d, ours + ("gate", "weight"))
    if hashed:
        yield f"{p}.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), \
            ours + ("gate", "tid2eid"), "int"
    else:
        yield f"{p}.gate.bias", (e,), ours + ("gate", "bias"), None
    for j in range(e):
        for w, ourname, shape in (("w1", "gate_proj", (i, d)), ("w3", "up_proj", (i, d)),
                                  ("w2", "down_proj", (d, i))):
            yield f"{p}.experts.{j}.{w}.weight", shape, ours + ("experts", ourname), "expert"
    for w, ourname, shape in (("w1", "gate_proj", (i, d)), ("w3", "up_proj", (i, d)),
                              ("w2", "down_proj", (d, i))):
        yield _linear(f"{p}.shared_experts.{w}.weight", *shape,
                      ours + ("shared_experts", ourname, "weight"))


def entries(cfg: V4Config):
    """(canonical name, torch shape, our parameter path, how) for every tensor. how:
    "T" transpose, None as is, "expert" one row of a stacked [E, in, out] parameter,
    "groups" wo_a as [g, H·D/g, d_g], "int" an integer table."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    yield "embed_tokens.weight", (v, d), ("embed",), None
    for layer in range(cfg.num_hidden_layers):
        p, ours = f"layers.{layer}", ("layers", layer)
        for site in ("attn", "ffn"):
            yield _linear(f"{p}.hc_{site}_fn", (2 + n) * n, n * d, ours + (f"hc_{site}", "fn"))
            yield f"{p}.hc_{site}_base", ((2 + n) * n,), ours + (f"hc_{site}", "base"), None
            yield f"{p}.hc_{site}_scale", (3,), ours + (f"hc_{site}", "scale"), None
            yield f"{p}.{site}_norm.weight", (d,), ours + (f"{site}_norm", "weight"), None
        yield from _attention(cfg, f"{p}.attn", ours + ("attn",), cfg.layer_types[layer])
        yield from _ffn(cfg, f"{p}.ffn", ours + ("ffn",), cfg.mlp_layer_types[layer] == "hash_moe")
    yield _linear("hc_head.hc_fn", n, n * d, ("hc_head", "fn"))
    yield "hc_head.hc_base", (n,), ("hc_head", "base"), None
    yield "hc_head.hc_scale", (1,), ("hc_head", "scale"), None
    yield "norm.weight", (d,), ("norm", "weight"), None
    if not cfg.tie_word_embeddings:
        yield _linear("head.weight", v, d, ("head", "weight"))


def _convert(arr: np.ndarray, how: Any, cfg: V4Config) -> np.ndarray:
    if how == "T":
        return arr.T
    if how == "groups":
        g = cfg.o_groups
        return arr.reshape(g, -1, arr.shape[-1]).transpose(0, 2, 1)
    return arr


def model_from_tensors(cfg: V4Config, tensors: Mapping[str, np.ndarray]) -> DeepseekV4:
    """The model from canonical-named numpy tensors (validated: every expected name with
    its shape, nothing unknown). Nothing random is materialised."""
    table = list(entries(cfg))
    known = {e[0] for e in table}
    missing = sorted(known - tensors.keys())
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unknown = sorted(n for n in tensors.keys() - known
                     if not any(p.fullmatch(n) for p in _IGNORED))
    if unknown:
        raise CheckpointError(f"unknown tensor {unknown[0]!r} ({len(unknown)} unknown in all)")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0))))
    flat = {tuple(p): var for p, var in nnx.to_flat_state(state)}
    values: dict[tuple, Any] = {}
    for name, shape, path, how in table:
        arr = np.asarray(tensors[name])
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {list(arr.shape)}, expected "
                                  f"{list(shape)}")
        if how == "expert":
            values.setdefault(path, []).append(arr.T)
        else:
            values[path] = _convert(arr, how, cfg)
    if cfg.tie_word_embeddings:
        values[("head", "weight")] = np.asarray(tensors["embed_tokens.weight"]).T
    for path, var in flat.items():
        want = var.get_value()
        arr = values[path]
        arr = np.stack(arr) if isinstance(arr, list) else arr
        if path[-1] == "tid2eid" and (arr.min() < 0 or arr.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"tensor {'.'.join(map(str, path))} holds expert ids outside "
                                  f"0..{cfg.n_routed_experts - 1}")
        var.set_value(jnp.asarray(arr, dtype=want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def read_v4_config(path: str | pathlib.Path, **overrides: Any) -> V4Config:
    cfg_file = pathlib.Path(path) / "config.json"
    try:
        d = json.loads(cfg_file.read_text())
        return V4Config.from_hf_dict(d, **overrides)
    except (OSError, ValueError, TypeError) as err:
        kind = "" if isinstance(err, ConfigError) else f"{type(err).__name__}: "
        raise CheckpointError(f"{cfg_file}: {kind}{err}") from None


def _read(e: st.TensorEntry, dtype: np.dtype) -> np.ndarray:
    if e.dtype in _INT_DTYPES:
        raw = np.memmap(e.file, dtype=_INT_DTYPES[e.dtype], mode="r", offset=e.start,
                        shape=e.shape) if e.end > e.start else np.zeros(e.shape, np.int64)
        return np.asarray(raw, np.int32)
    if e.dtype not in ("F32", "BF16"):
        raise CheckpointError(f"tensor {e.name!r} ({e.file.name}) has dtype {e.dtype}: "
                              "allowed F32, BF16, or a quantised weight with its scale")
    arr = np.array(st.read_tensor(e), dtype=dtype)
    if not np.isfinite(arr).all():
        raise CheckpointError(f"tensor {e.name!r} ({e.file.name}) holds NaN or Inf")
    return arr


def load_v4(path: str | pathlib.Path, **overrides: Any) -> tuple[V4Config, DeepseekV4]:
    """(config, model) of a deepseek_v4 HF directory (model.safetensors or shards);
    `overrides` apply to the config (e.g. dtype="float32")."""
    cfg = read_v4_config(path, **overrides)
    entries_ = st.index_checkpoint(path)
    scales = quant.pair_scales(entries_)
    names: dict[str, st.TensorEntry] = {}
    for name, e in entries_.items():
        canon = canonical_name(name)
        if quant.is_scale(name) or any(p.fullmatch(canon) for p in _IGNORED):
            continue
        if canon in names:
            raise CheckpointError(f"tensor {name!r} and {names[canon].name!r} are the same "
                                  "tensor under two spellings")
        names[canon] = e
    tensors = {}
    for n, e in names.items():
        scale = scales.get(e.name)
        tensors[n] = (_read(e, np.dtype(np.float32)) if scale is None
                      else quant.read_dequantized(e, scale))
    return cfg, model_from_tensors(cfg, tensors)
