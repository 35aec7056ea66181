"""One static, validated config tree: model / cache / engine / serve / mesh.

Every number has one home here. Named instances live in `configs/*.py`, each defining
a module-level `CONFIG`; `load_config(path)` reads one. Invalid values raise
`ConfigError` naming the field and what is allowed, at construction time: every field's
type is checked against its annotation (bools reject non-bools, floats accept ints,
numpy scalars become Python ones), then its range. `ModelConfig.from_hf_dict` reads a
Hugging Face config.json, whose shape-deciding fields are required (`HF_REQUIRED`), and
`hf_dtype` its compute dtype. `load_config` turns any failure of a config file into one
ConfigError naming the file and line, and checks cache.storage_path on disk.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import math
import numbers
import os
import pathlib
import traceback
import warnings
from typing import Any, Mapping


class ConfigError(ValueError):
    """A config field holds a value outside what is allowed; the message names both."""


def _check(cond: bool, field: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is invalid: allowed {allowed}")


def _positive(obj: Any, prefix: str, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _check(isinstance(v, int) and not isinstance(v, bool) and v > 0,
               f"{prefix}.{n}", v, "a positive integer")


def _one_of(obj: Any, prefix: str, name: str, allowed: tuple[str, ...]) -> None:
    v = getattr(obj, name)
    _check(v in allowed, f"{prefix}.{name}", v, "one of " + ", ".join(map(repr, allowed)))


# ---- type checks -------------------------------------------------------------------
# Every field's annotation (a string: `from __future__ import annotations`) names what it
# may hold; `_check_types` runs first in each __post_init__, so the range checks after it
# never meet a str where they compare numbers. numpy scalars are accepted and stored as
# the Python type (configs are rendered back to source by tools/tune.py).

_SCALARS = {"int": "an integer", "float": "a finite number", "bool": "a bool (True/False)",
            "str": "a string", "None": "None"}


def _scalar_ok(kind: str, v: Any) -> bool:
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "int":
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if kind == "float":
        return (isinstance(v, numbers.Real) and not isinstance(v, bool)
                and math.isfinite(float(v)))
    if kind == "str":
        return isinstance(v, str)
    return v is None


def _as_python(v: Any) -> Any:
    """A numpy scalar (0-d, with .item()) as its Python value; anything else as is."""
    if hasattr(v, "dtype") and hasattr(v, "item") and getattr(v, "shape", None) == ():
        return v.item()
    return v


_TYPES = {"tuple": tuple}   # non-scalar builtins an annotation may name


def _check_types(obj: Any, prefix: str) -> None:
    """Type-check every field of the dataclass `obj` against its annotation."""
    for f in dataclasses.fields(obj):
        raw = getattr(obj, f.name)
        v = _as_python(raw)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if any(_scalar_ok(k, v) if k in _SCALARS
               else isinstance(v, _TYPES.get(k) or globals()[k]) for k in kinds):
            if v is not raw:
                object.__setattr__(obj, f.name, v)
            continue
        allowed = " or ".join(_SCALARS.get(k, f"a {k}") for k in kinds)
        _check(False, f"{prefix}.{f.name}", raw, f"{allowed} (got {type(raw).__name__})")


# Knobs renamed in this release: old spelling → new, per section. The old spellings stay
# accepted (CacheConfig(...) keywords, --override, Config.replace) for one release, each
# use warning once with the new name, so existing config files and scripts keep working.
RENAMED: dict[str, dict[str, str]] = {
    "cache": {"staging_capacity": "hot_buffer_rows", "prefetch_window": "fetch_chunk_rows"},
}


class RenamedKnobWarning(FutureWarning):
    """An old knob spelling was used. A FutureWarning (not DeprecationWarning) because the
    readers are users of the CLIs and config files, and Python shows it by default."""


def current_name(section: str, field: str) -> str:
    """`field`'s name in this release: an old spelling (RENAMED) maps to the new one and
    warns, naming it; any other name comes back unchanged."""
    new = RENAMED.get(section, {}).get(field)
    if new is None:
        return field
    warnings.warn(f"{section}.{field} is deprecated: it is now {section}.{new} (the old "
                  "name is accepted for one more release)", RenamedKnobWarning, stacklevel=3)
    return new


def _accepts_renamed(section: str):
    """Class decorator: the dataclass's keyword constructor takes the section's old
    spellings too (so configs/*.py files written for the last release still load)."""
    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            new = {}
            for key, val in kw.items():
                name = current_name(section, key)
                if name in new or (name != key and name in kw):
                    raise TypeError(f"{section}.{key} and {section}.{name} are the same "
                                    f"knob; give only {section}.{name}")
                new[name] = val
            init(self, *args, **new)
        cls.__init__ = __init__
        return cls
    return wrap


DTYPES = ("bfloat16", "float32", "float16")   # model.dtype: the compute (and weight) dtype

# model.model_type: the checkpoint families jlco implements (config.json `model_type`).
# deepseek_v32: DeepSeek-V3.2(-Exp); glm_moe_dsa: GLM-5 / 5.1 / 5.2 (the same MLA + DSA, the
# indexer's RoPE interleaved, and from 5.2 on IndexShare: layers that reuse a top-k).
# deepseek_v4: DeepSeek-V4 (compressed attention, hyper-connections), whose architecture
# is its own dataclass (jlco.model.deepseek_v4.config.V4Config); ModelConfig holds the
# MLA families only (MLA_MODEL_TYPES).
MLA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
V4_MODEL_TYPE = "deepseek_v4"
MODEL_TYPES = MLA_MODEL_TYPES + (V4_MODEL_TYPE,)
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek-V3.2: factor 40 over an original 4096 context)."""
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self):
        p = "model.rope_scaling"
        _check_types(self, p)
        _check(self.factor >= 1.0, f"{p}.factor", self.factor, ">= 1.0")
        _positive(self, p, "original_max_position_embeddings")
        _check(self.beta_fast > self.beta_slow > 0, f"{p}.beta_fast",
               (self.beta_fast, self.beta_slow), "beta_fast > beta_slow > 0")
        for name in ("mscale", "mscale_all_dim"):
            _check(getattr(self, name) >= 0, f"{p}.{name}", getattr(self, name), ">= 0")


class ModelArchitecture:
    """Base of a model architecture that is not ModelConfig's MLA (DeepSeek-V4:
    `jlco.model.deepseek_v4.config.V4Config`). `Config.model` may hold one; the
    MLA-only properties (row_bytes, indexer_key_bytes, hot-buffer sizing, fetch path)
    are then not consulted, and `Config` refuses the knobs the architecture's engine
    does not run (`Config.is_v4`)."""
    model_type: str


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V3.2-style model. Defaults are the real 671B model."""
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 3
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    indexer_fp8: bool = False
    model_type: str = "deepseek_v32"
    # Per main layer "dense" | "sparse" (MoE); None = first_k_dense_replace dense layers.
    mlp_layer_types: tuple | None = None
    # Per main layer "full" (runs its indexer) | "shared" (reuses the top-k of the last
    # full layer before it: no indexer weights, no indexer keys); None = all full.
    indexer_types: tuple | None = None

    def __post_init__(self):
        p = "model"
        for name in ("mlp_layer_types", "indexer_types"):   # JSON (a manifest) gives lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _check_types(self, p)
        _positive(self, p, "vocab_size", "hidden_size", "intermediate_size",
                  "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "index_n_heads", "index_head_dim", "index_topk",
                  "max_position_embeddings")
        _check(0 <= self.first_k_dense_replace <= self.num_hidden_layers,
               f"{p}.first_k_dense_replace", self.first_k_dense_replace,
               f"0..num_hidden_layers ({self.num_hidden_layers})")
        _check(self.n_shared_experts >= 0, f"{p}.n_shared_experts", self.n_shared_experts, ">= 0")
        _check(self.num_nextn_predict_layers in (0, 1), f"{p}.num_nextn_predict_layers",
               self.num_nextn_predict_layers, "0 or 1")
        _check(self.qk_rope_head_dim % 2 == 0, f"{p}.qk_rope_head_dim",
               self.qk_rope_head_dim, "an even number")
        _check(self.index_head_dim > self.qk_rope_head_dim, f"{p}.index_head_dim",
               self.index_head_dim, f"> qk_rope_head_dim ({self.qk_rope_head_dim})")
        _check(self.n_routed_experts % self.n_group == 0, f"{p}.n_group", self.n_group,
               f"a divisor of n_routed_experts ({self.n_routed_experts})")
        _check(self.topk_group <= self.n_group, f"{p}.topk_group", self.topk_group,
               f"<= n_group ({self.n_group})")
        _check(self.num_experts_per_tok <= self.topk_group * self.n_routed_experts // self.n_group,
               f"{p}.num_experts_per_tok", self.num_experts_per_tok,
               "<= topk_group * experts per group")
        _check(self.rms_norm_eps > 0, f"{p}.rms_norm_eps", self.rms_norm_eps, "> 0")
        _check(self.rope_theta > 0, f"{p}.rope_theta", self.rope_theta, "> 0")
        _check(self.routed_scaling_factor > 0, f"{p}.routed_scaling_factor",
               self.routed_scaling_factor, "> 0")
        _check(self.index_topk <= self.max_position_embeddings, f"{p}.index_topk",
               self.index_topk, f"<= max_position_embeddings ({self.max_position_embeddings})")
        _one_of(self, p, "dtype", DTYPES)
        _check(self.model_type != "deepseek_v4", f"{p}.model_type", self.model_type,
               "one of " + ", ".join(map(repr, MLA_MODEL_TYPES)) + " (a deepseek_v4 "
               "architecture is a jlco.model.deepseek_v4.config.V4Config)")
        _one_of(self, p, "model_type", MLA_MODEL_TYPES)
        self._check_layer_types(p)

    def _check_layer_types(self, p: str) -> None:
        """mlp_layer_types / indexer_types: one allowed entry per main layer; layer 0
        runs its indexer (a shared layer needs a full one before it)."""
        for name, allowed in (("mlp_layer_types", MLP_LAYER_TYPES),
                              ("indexer_types", INDEXER_TYPES)):
            v = getattr(self, name)
            if v is None:
                continue
            _check(len(v) == self.num_hidden_layers and all(t in allowed for t in v),
                   f"{p}.{name}", v, f"{self.num_hidden_layers} entries (num_hidden_layers), "
                   "each one of " + ", ".join(map(repr, allowed)))
        if self.indexer_types is not None:
            _check(self.indexer_types[0] == "full", f"{p}.indexer_types", self.indexer_types,
                   "'full' for layer 0 (a shared layer reuses an earlier full layer's top-k)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one MLA latent row: kv_lora_rank (nope) + qk_rope_head_dim (rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim and rs.factor > 1:
            m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` has the MoE block (the MTP layer, past the main ones, always)."""
        if self.mlp_layer_types is None or layer >= self.num_hidden_layers:
            return layer >= self.first_k_dense_replace
        return self.mlp_layer_types[layer] == "sparse"

    def shares_topk(self, layer: int) -> bool:
        """Layer `layer` reuses the top-k of the last full layer before it (IndexShare):
        it has no indexer and caches no indexer keys. The MTP layer never does."""
        return (self.indexer_types is not None and layer < self.num_hidden_layers
                and self.indexer_types[layer] == "shared")

    @property
    def indexer_layers(self) -> int:
        """Main layers that run an indexer (and cache its keys)."""
        return sum(not self.shares_topk(i) for i in range(self.num_hidden_layers))

    @property
    def indexer_rope_interleaved(self) -> bool:
        """The indexer's RoPE: interleaved pairs for GLM (glm_moe_dsa), half split for
        DeepSeek-V3.2 (docs/facts.md §1, §6)."""
        return self.model_type == "glm_moe_dsa"

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (unknown keys are ignored).

        Every field that decides a weight's shape or the model's arithmetic is required
        (HF_REQUIRED): a missing one would otherwise take the 671B model's default and
        fail much later, or not at all. Types and ranges are checked by the dataclass.
        The compute dtype is not read here (`hf_dtype` reads it; the caller decides)."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {
            "rope_scaling", "dtype", "indexer_fp8", "model_type", "mlp_layer_types",
            "indexer_types"}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        kw.update(_hf_family(d))
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        if rs is not None and not isinstance(rs, Mapping):
            raise ConfigError(f"config.json field 'rope_scaling'/'rope_parameters'={rs!r} is "
                              "invalid: allowed a JSON object or null")
        if "rope_theta" not in kw and isinstance(rs, Mapping) and rs.get("rope_theta") is not None:
            kw["rope_theta"] = rs["rope_theta"]
        if isinstance(rs, Mapping) and rs.get("rope_type", rs.get("type")) == "yarn":
            rs_names = {f.name for f in dataclasses.fields(RopeScaling)}
            kw["rope_scaling"] = RopeScaling(**{k: rs[k] for k in rs_names if k in rs})
        else:
            kw["rope_scaling"] = None
        kw.update(overrides)
        missing = [k for k in HF_REQUIRED if k not in kw]
        if missing:
            raise ConfigError(f"config.json is missing required field(s) "
                              f"{', '.join(map(repr, missing))}: each must be set (no "
                              "default: the 671B model's value would be used silently)")
        return cls(**kw)


def _hf_family(d: Mapping[str, Any]) -> dict[str, Any]:
    """The family-specific fields of a config.json: model_type (refused unless jlco
    implements it: another family's weights would otherwise load by name and decode
    wrongly), mlp_layer_types, and for glm_moe_dsa its indexer pattern and defaults."""
    mt = d.get("model_type")
    if mt not in MODEL_TYPES:
        raise ConfigError(f"config.json field 'model_type'={mt!r} is invalid: jlco implements "
                          + ", ".join(map(repr, MODEL_TYPES)))
    for key, want in (("attention_bias", False), ("hidden_act", "silu")):
        if d.get(key, want) != want:
            raise ConfigError(f"config.json field {key!r}={d[key]!r} is invalid: allowed "
                              f"{want!r} (the only value jlco implements)")
    if mt == "deepseek_v4":
        raise ConfigError("config.json field 'model_type'='deepseek_v4' is invalid for the MLA "
                          "ModelConfig: a deepseek_v4 config.json is read as a "
                          "jlco.model.deepseek_v4.config.V4Config "
                          "(jlco.checkpoint.deepseek_v4.read_v4_config; jlco.generate and "
                          "jlco.serve --checkpoint do so)")
    kw: dict[str, Any] = {"model_type": mt}
    n = d.get("num_hidden_layers")
    mlp = d.get("mlp_layer_types")
    if mlp is not None:
        _check(isinstance(mlp, list), "config.json field 'mlp_layer_types'", mlp, "a list")
        dense = d.get("first_k_dense_replace")
        if isinstance(n, int) and dense is not None and mlp == _default_mlp(dense, n):
            mlp = None            # the first_k_dense_replace rule says the same
        kw["mlp_layer_types"] = None if mlp is None else tuple(mlp)
    if mt == "glm_moe_dsa":
        # transformers' GlmMoeDsaConfig defaults, which differ from DeepSeek-V3.2's.
        kw.update({k: v for k, v in (("n_group", 1), ("topk_group", 1)) if d.get(k) is None})
        types = _glm_indexer_types(d, n)
        kw["indexer_types"] = None if types is None or "shared" not in types else tuple(types)
    return kw


def _default_mlp(dense: Any, n: int) -> list[str]:
    k = min(dense, n) if isinstance(dense, int) else 0
    return ["dense"] * k + ["sparse"] * (n - k)


def _glm_indexer_types(d: Mapping[str, Any], n: Any) -> list | None:
    """GLM's per-layer indexer modes, read as transformers' GlmMoeDsaConfig reads them:
    `indexer_types`, else `index_topk_pattern` ("FSSF...", or a list), else the schedule
    `index_topk_freq` (default 1: all full) / `index_skip_topk_offset` (default 2):
    layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    field = "config.json field"
    if d.get("indexer_types") is not None:
        types = d["indexer_types"]
        _check(isinstance(types, list), f"{field} 'indexer_types'", types, "a list")
        return types
    pattern = d.get("index_topk_pattern")
    if isinstance(pattern, str):
        codes = {"F": "full", "S": "shared"}
        _check(set(pattern) <= set(codes), f"{field} 'index_topk_pattern'", pattern,
               "a string of 'F' (full) and 'S' (shared)")
        return [codes[c] for c in pattern]
    if pattern is not None:
        _check(isinstance(pattern, list), f"{field} 'index_topk_pattern'", pattern,
               "a string of F/S or a list")
        return pattern
    freq, offset = d.get("index_topk_freq", 1), d.get("index_skip_topk_offset", 2)
    for key, v in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        _check(isinstance(v, int) and not isinstance(v, bool), f"{field} {key!r}", v,
               "an integer")
    if not isinstance(n, int):
        return None               # num_hidden_layers is reported missing by the caller
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


# config.json fields that must be present: everything that decides a weight's shape, the
# routing or the arithmetic. Optional: tie_word_embeddings (False), num_nextn_predict_layers
# (the loader decides from the tensors), rope_scaling (absent = no YaRN).
HF_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "index_n_heads", "index_head_dim",
    "index_topk", "rms_norm_eps", "rope_theta", "max_position_embeddings")

# torch dtype names a config.json may give (`dtype` in transformers 5, `torch_dtype`
# before) -> model.dtype.
_HF_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
              "float16": "float16", "half": "float16"}


def hf_dtype(d: Mapping[str, Any]) -> tuple[str | None, str]:
    """(model dtype, the config.json key it came from) or (None, "") when config.json
    names none. An unsupported dtype is a ConfigError naming the key."""
    for key in ("dtype", "torch_dtype"):
        v = d.get(key) if isinstance(d, Mapping) else None
        if v is None:
            continue
        name = str(v).removeprefix("torch.")
        if not isinstance(v, str) or name not in _HF_DTYPES:
            raise ConfigError(f"config.json field {key!r}={v!r} is invalid: allowed "
                              + ", ".join(map(repr, sorted(_HF_DTYPES))))
        return _HF_DTYPES[name], key
    return None, ""


@_accepts_renamed("cache")
@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Where the MLA latent cache lives and how rows move (the offload knobs).

    offload:           latent cache in host memory (True) or all on device (False).
    storage:           host memory kind for the latent pool, or "file" (memory-mapped
                       file under storage_path).
    kv_format:         latent row format: "fp8" (656-byte FlashMLA layout), "bf16" (1152 B),
                       or "f32" (unquantised f32 rows, for fp32 parity tests).
    page_size:         tokens per host page; pages have exactly one owning request.
    hot_buffer_rows:   hot-buffer rows per request per layer (device). Must be at least
                       index_topk * (1 + num_draft_tokens); 0 means "that minimum".
                       (Was `staging_capacity`; that spelling is accepted for one release.)
    fetch_chunk_rows:  most rows per host->device fetch chunk (later chunks gather while
                       earlier ones transfer); 0 = one chunk; "auto" = on the
                       host-driven path derived from the transfer path measured at
                       start-up (`jlco.offload.schedule`: a chunk's transfer is 8x its
                       fixed cost; `planning.probe.host_transfer`), on the in-jit path
                       256 (a shape of the compiled step: never from a timing).
                       (Was `prefetch_window`; that spelling is accepted for one release.)
    prefetch_threads:  host threads issuing prefetch transfers.
    eviction:          hot-buffer victim policy.
    fetch_path:        how misses reach the device ("auto" = measured default per backend).
    host_headroom:     fraction of extra host memory kept free (the design requires at
                       least 30 %).
    prefix_cache:      keep the full pages of finished prefills in host memory and
                       prefill a prompt that starts with one from there on (multi-turn
                       sessions reuse their history; exact: jlco.engine.prefix).
    prefix_cache_tokens: positions the prefix cache holds at most (least recently used
                       pages go first); 0 = 2 x engine.max_context_len.
    split_attention:   host-driven path: attend over the rows already resident while the
                       step's misses transfer, then over the fetched ones, and merge the
                       two by log-sum-exp (within f32 rounding of one attention). The
                       in-jit path refuses it: its step is one XLA program, with no host
                       in between to start the attention before the fetch.
    prefetch_ahead:    host-driven path: while layer L computes, layer L+1's indexer scores
                       layer L's input, and the rows it predicts that are not resident
                       are fetched ahead (flagged as prefetched); L+1's real top-k then
                       fetches only what the prediction missed. Exact (the real selection
                       decides); off until measured on an accelerator. Refused in-jit as
                       split_attention is.
    prefetch_depth:    layers ahead the prefetch predicts (layer L's input predicts layer
                       L + depth), 1..4, or "auto": each step, the fewest layers whose
                       measured compute time covers the transfer of one layer's predicted
                       rows at the measured link rate (`jlco.offload.schedule`).
    """
    offload: bool = False
    storage: str = "pinned_host"
    storage_path: str | None = None
    kv_format: str = "bf16"
    page_size: int = 64
    hot_buffer_rows: int = 0
    fetch_chunk_rows: int | str = "auto"
    prefetch_threads: int = 2
    eviction: str = "lru"
    fetch_path: str = "auto"
    host_headroom: float = 0.3
    indexer_key_format: str = "bf16"
    prefix_cache: bool = True
    prefix_cache_tokens: int = 0
    split_attention: bool = False
    prefetch_ahead: bool = False
    prefetch_depth: int | str = "auto"

    def __post_init__(self):
        p = "cache"
        _check_types(self, p)
        _one_of(self, p, "storage", ("pinned_host", "unpinned_host", "file"))
        _check(self.storage != "file" or bool(self.storage_path), f"{p}.storage_path",
               self.storage_path, "a directory path when cache.storage='file'")
        _one_of(self, p, "kv_format", ("bf16", "f32", "fp8"))
        _one_of(self, p, "eviction", ("lru", "fifo"))
        _one_of(self, p, "fetch_path", ("auto", "in_jit", "host_driven"))
        _one_of(self, p, "indexer_key_format", ("bf16", "fp8"))
        _positive(self, p, "page_size", "prefetch_threads")
        _check(isinstance(self.hot_buffer_rows, int) and self.hot_buffer_rows >= 0,
               f"{p}.hot_buffer_rows", self.hot_buffer_rows, "an integer >= 0 (0 = minimum)")
        _check(self.fetch_chunk_rows == "auto" or (isinstance(self.fetch_chunk_rows, int)
                                                    and self.fetch_chunk_rows >= 0),
               f"{p}.fetch_chunk_rows", self.fetch_chunk_rows,
               "'auto' or an integer >= 0 (0 = one chunk)")
        # 4: jlco.offload.schedule.MAX_DEPTH (config imports no other jlco package)
        _check(self.prefetch_depth == "auto" or (isinstance(self.prefetch_depth, int)
                                                  and 1 <= self.prefetch_depth <= 4),
               f"{p}.prefetch_depth", self.prefetch_depth, "'auto' or an integer in 1..4")
        _check(0.3 <= self.host_headroom <= 4.0, f"{p}.host_headroom", self.host_headroom,
               "0.3..4.0 (the design requires at least 30 % host headroom)")
        _check(isinstance(self.prefix_cache_tokens, int) and self.prefix_cache_tokens >= 0,
               f"{p}.prefix_cache_tokens", self.prefix_cache_tokens,
               "an integer >= 0 (0 = 2 x engine.max_context_len)")
        self._check_host_driven_knobs(p)

    def _check_host_driven_knobs(self, p: str) -> None:
        """Knobs that schedule the host-driven path's fetches need that path: an in-jit
        step is one XLA program, with no host between its selection and its attention."""
        host = self.fetch_path == "host_driven" or (self.fetch_path == "auto"
                                                    and self.storage == "file")
        for name in ("split_attention", "prefetch_ahead"):
            if getattr(self, name):
                _check(self.offload and host, f"{p}.{name}", True,
                       "False unless cache.offload=True and the host-driven fetch path "
                       "(cache.fetch_path='host_driven'): the in-jit step is one XLA "
                       "program with no host between its selection and its attention")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Batching and step shape.

    max_batch_size:     requests decoded together.
    max_context_len:    longest prompt + generation per request, in tokens.
    prefill_chunk:      prompt tokens per prefill chunk (bounds the [chunk, L] score matrix).
    num_draft_tokens:   MTP draft tokens per step (0 = no speculation); s_q = 1 + this.
    spec_sampling:      how speculative decoding treats sampled requests (temperature > 0;
                        greedy ones are always exact): "per_token" samples every verified
                        position with the request's own per-token key and accepts a draft
                        when it equals that sample (the very stream non-speculative
                        sampling draws); "rejection" accepts draft d with probability
                        min(1, p(d)/q(d)) and resamples a rejection from the residual
                        (exact in distribution). jlco's drafters propose one token (q a
                        point mass), so both accept with probability p(d): the same
                        acceptance; rejection pays off only with a sampling drafter.
    attention_impl:     "auto" picks the Pallas kernel on cuda/tpu and plain XLA elsewhere
                        (CPU), "xla" forces the plain-jnp fallback, "pallas" requires the
                        kernel, "interpret" runs the kernel in Pallas interpret mode off
                        accelerators (a test tool, slow).
    cpu_matmul:         decode-sized f32 matmuls (at most 8 rows) on one XLA:CPU device:
                        "auto" runs them on jlco's small-M kernel (`jlco.native`, C++
                        compiled on first use) when it builds here and on XLA's dot
                        otherwise (with a warning), "native" requires the kernel, "xla"
                        never uses it. XLA:CPU runs M = 2..8 at a third of its matvec
                        speed; the kernel streams each weight once for all rows.
    async_scheduling:   queue each decode step behind the one still computing, its
                        inputs (tokens, accepted drafts, limits, PRNG counts) taken on the
                        device from that step's outputs, and read the earlier step's
                        tokens while the device works (vLLM's async scheduling, SGLang's
                        overlap scheduler): the host's work per step (scheduling, inputs,
                        dispatch, reading tokens back) leaves the step's critical path.
                        Every step kind follows (plain or speculative, in-jit or
                        host-driven, one device or a mesh). The tokens are the same as
                        with it off; a request that stops on a stop token or string costs
                        its slot one discarded step. Batches holding a request with a
                        structured-output constraint (its next mask needs the token on the
                        host) wait for the step in flight; a drafter proposing on the host
                        makes steps synchronous (the banner says so).
    """
    max_batch_size: int = 1
    max_context_len: int = 4096
    prefill_chunk: int = 512
    num_draft_tokens: int = 0
    spec_sampling: str = "per_token"
    attention_impl: str = "auto"
    cpu_matmul: str = "auto"
    seed: int = 0
    async_scheduling: bool = True

    def __post_init__(self):
        p = "engine"
        _check_types(self, p)
        _positive(self, p, "max_batch_size", "max_context_len", "prefill_chunk")
        _check(0 <= self.num_draft_tokens <= 7, f"{p}.num_draft_tokens",
               self.num_draft_tokens, "an integer in 0..7")
        _one_of(self, p, "attention_impl", ("auto", "xla", "pallas", "interpret"))
        _one_of(self, p, "spec_sampling", ("per_token", "rejection"))
        _one_of(self, p, "cpu_matmul", ("auto", "native", "xla"))
        _check(0 <= self.seed < 2 ** 32, f"{p}.seed", self.seed, "an integer in 0..2**32-1")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """HTTP serving and admission.

    max_queue:              requests allowed to wait for admission; beyond it a new
                            request is refused (HTTP 429).
    host_high_watermark,    fractions of the host pool's pages (offload on): when a step
    host_low_watermark:     finds more than `high` reserved, admission pauses (requests
                            wait; /health answers 503 so a load balancer routes
                            elsewhere) until at most `low` are reserved again.
    device_high_watermark,  the same over the device pool: the batch slots' hot buffers
    device_low_watermark:   and caches (1.0 = admit while a slot is free).
    import_ttl_s:           a prefill imported from a prefill node (PD disaggregation)
                            that no request claims within this many seconds is freed by
                            the lifecycle sweep (counted as an orphan).
    """
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    host_high_watermark: float = 0.95
    host_low_watermark: float = 0.8
    device_high_watermark: float = 1.0
    device_low_watermark: float = 0.9
    import_ttl_s: float = 60.0

    def __post_init__(self):
        p = "serve"
        _check_types(self, p)
        _check(bool(self.host.strip()), f"{p}.host", self.host, "a host name or address")
        _check(0 <= self.port <= 65535, f"{p}.port", self.port, "0..65535")
        _positive(self, p, "max_queue")
        _check(self.import_ttl_s > 0, f"{p}.import_ttl_s", self.import_ttl_s,
               "a number of seconds > 0")
        for pool in ("host", "device"):
            low, high = getattr(self, f"{pool}_low_watermark"), getattr(self, f"{pool}_high_watermark")
            _check(0 < low < high <= 1.0, f"{p}.{pool}_high_watermark", (low, high),
                   f"0 < {pool}_low_watermark < {pool}_high_watermark <= 1")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh (`jlco.parallel.mesh.make_mesh`): its axes' sizes, whose product must be
    the number of devices. The defaults (all 1) are one device, no mesh.

    data:    data-parallel attention: requests, their caches and the host pool split over
             this many ranks (engine.max_batch_size must divide evenly).
    expert:  expert parallelism: the routed experts are split over this many devices and
             tokens reach them by all-to-all (model.n_routed_experts must divide evenly).
    tensor:  tensor parallelism of heads / MLP / vocabulary dimensions.
    """
    data: int = 1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        p = "mesh"
        _check_types(self, p)
        _positive(self, p, "data", "expert", "tensor")

    @property
    def num_devices(self) -> int:
        return self.data * self.expert * self.tensor


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig | ModelArchitecture = ModelConfig()
    cache: CacheConfig = CacheConfig()
    engine: EngineConfig = EngineConfig()
    serve: ServeConfig = ServeConfig()
    mesh: MeshConfig = MeshConfig()
    name: str = "unnamed"

    def __post_init__(self):
        _check_types(self, "config")
        _check(bool(self.name.strip()), "config.name", self.name, "a non-empty string")
        m, c, e = self.model, self.cache, self.engine
        _check(e.max_context_len <= m.max_position_embeddings, "engine.max_context_len",
               e.max_context_len, f"<= model.max_position_embeddings ({m.max_position_embeddings})")
        if self.is_v4:
            self._check_v4()
            return
        _check(e.num_draft_tokens == 0 or m.num_nextn_predict_layers > 0,
               "engine.num_draft_tokens", e.num_draft_tokens,
               "0 when the model has no MTP layer (model.num_nextn_predict_layers=0)")
        _check(c.kv_format != "fp8" or m.kv_lora_rank % 128 == 0, "cache.kv_format", c.kv_format,
               f"'bf16' unless model.kv_lora_rank ({m.kv_lora_rank}) is a multiple of 128")
        if c.offload and c.hot_buffer_rows:
            _check(c.hot_buffer_rows >= self.min_hot_buffer_rows, "cache.hot_buffer_rows",
                   c.hot_buffer_rows, f">= index_topk * (1 + num_draft_tokens) = "
                   f"{self.min_hot_buffer_rows} (or 0 for that minimum)")

    @property
    def is_v4(self) -> bool:
        """The model is DeepSeek-V4 (`model.model_type` deepseek_v4): the engine runs it
        with `jlco.engine.v4_runner.V4Runner`, not the MLA runner."""
        return self.model.model_type == V4_MODEL_TYPE

    def _check_v4(self) -> None:
        """The knobs the V4 engine does not run yet, refused naming the field and why.
        Offload moves the CSA entries (hot_buffer_rows, eviction and storage apply to
        them). Not consulted with V4: kv_format, page_size, fetch_chunk_rows,
        indexer_key_format and engine.cpu_matmul."""
        c, e, why = self.cache, self.engine, "is not implemented for deepseek_v4 yet"
        if c.offload:
            _check(c.storage != "file" and c.fetch_path != "host_driven", "cache.fetch_path",
                   (c.fetch_path, c.storage), "'auto' or 'in_jit' with storage 'pinned_host' "
                   f"or 'unpinned_host' for a deepseek_v4 model (its entries are fetched in "
                   f"the jitted step; the host-driven path {why})")
            _check(not c.hot_buffer_rows or c.hot_buffer_rows >= self.min_hot_buffer_rows,
                   "cache.hot_buffer_rows", c.hot_buffer_rows, f">= index_topk = "
                   f"{self.min_hot_buffer_rows} (or 0 for that minimum): a deepseek_v4 "
                   "step's CSA picks must all be resident at once")
        _check(not c.prefix_cache, "cache.prefix_cache", c.prefix_cache, "False with a "
               "deepseek_v4 model (its per-request state, a sliding window and compressor "
               "buffers, is not paged, so no prefix is shared; jlco.generate and jlco.serve "
               "turn it off)")
        _check(e.num_draft_tokens == 0, "engine.num_draft_tokens", e.num_draft_tokens,
               f"0 with a deepseek_v4 model (its MTP layer is not loaded: MTP drafts {why})")
        _check(self.mesh.data == 1, "mesh.data", self.mesh.data, "1 with a deepseek_v4 model "
               f"(data-parallel attention over its state {why}; expert and tensor run)")
        _check(not (c.offload and self.mesh.num_devices > 1), "cache.offload", c.offload,
               f"False with a deepseek_v4 model on a mesh (its host pools on a mesh {why})")
        _check(e.attention_impl in ("auto", "xla"), "engine.attention_impl", e.attention_impl,
               "'auto' or 'xla' with a deepseek_v4 model (its attention is plain XLA)")

    @property
    def row_bytes(self) -> int:
        """Bytes of one latent row: fp8 = nope e4m3 | f32 scale per 128 | bf16 rope (656 B
        for DeepSeek-V3.2); bf16 = 2 bytes per latent value (1152 B)."""
        m = self.model
        if self.cache.kv_format == "fp8":
            return m.kv_lora_rank + 4 * (m.kv_lora_rank // 128) + 2 * m.qk_rope_head_dim
        return (4 if self.cache.kv_format == "f32" else 2) * m.latent_dim

    @property
    def indexer_key_bytes(self) -> int:
        """Device bytes per token per layer of the indexer cache (fp8: 128 + 4 = 132 B;
        "bf16" keys stay unquantised in the model dtype, so f32 models store 4 B each)."""
        d = self.model.index_head_dim
        if self.cache.indexer_key_format == "fp8":
            return d + 4
        return (4 if self.model.dtype == "float32" else 2) * d

    @property
    def min_hot_buffer_rows(self) -> int:
        """Fewest hot-buffer rows a step can work with: every query token's top-k set
        (the target token and each draft) must be resident at once."""
        return self.model.index_topk * (1 + self.engine.num_draft_tokens)

    @property
    def hot_buffer_rows(self) -> int:
        """Hot-buffer rows per request per layer, with 0 resolved to the minimum."""
        return self.cache.hot_buffer_rows or self.min_hot_buffer_rows

    def resolved_fetch_path(self) -> str:
        """The miss-fetch path an offloaded engine runs: "in_jit" or "host_driven" (the
        decode step's fetch strategy, `jlco.engine.decode`).

        "auto" is in_jit except for storage "file", whose memmap only the host-driven path
        reads. Measured on the 2-core CPU box (configs/tiny.py, f32 rows, warm median step,
        `python tools/bench_fetch_path.py --batch=2` / `--batch=4`): in_jit 2.5 / 3.6 ms,
        host_driven 11.0 / 14.9 ms (fetch wait 4.2 / 5.3 ms): per layer it pays ~10
        dispatches and 2 syncs that the single jitted step does not. Re-measure on
        accelerators, where the in-jit gather's padding and host compute cost more."""
        path, storage = self.cache.fetch_path, self.cache.storage
        if path == "auto":
            return "host_driven" if storage == "file" else "in_jit"
        if path == "in_jit" and storage == "file":
            raise NotImplementedError(
                "cache.fetch_path='in_jit' with cache.storage='file': a jitted step cannot "
                "address an np.memmap pool; use cache.fetch_path='host_driven' (or 'auto')")
        return path

    def replace(self, **sections: Any) -> "Config":
        """Copy with whole sections or `section__field=value` overrides replaced. A
        section's overrides apply together, so fields that are only valid jointly
        (cache__storage='file' with cache__storage_path) can be set in one call."""
        kw: dict[str, Any] = {}
        per_section: dict[str, dict[str, Any]] = {}
        for key, val in sections.items():
            if "__" in key:
                sec, field = key.split("__", 1)
                per_section.setdefault(sec, {})[current_name(sec, field)] = val
            else:
                kw[key] = val
        for sec, fields in per_section.items():
            kw[sec] = dataclasses.replace(kw.get(sec, getattr(self, sec)), **fields)
        return dataclasses.replace(self, **kw)


def load_config(path: str | pathlib.Path) -> Config:
    """Execute a python config file and return its module-level `CONFIG`.

    Whatever goes wrong becomes one ConfigError naming the file (and the line, for an
    exception raised while the file runs): a bad value, a typo'd field name, a syntax
    error. With cache.storage='file', cache.storage_path is checked here, against the
    filesystem (Config itself stays pure: a config may be built on another machine)."""
    path = pathlib.Path(path)
    mod = run_config_file(path)
    cfg = getattr(mod, "CONFIG", None)
    if cfg is None and getattr(mod, "DEPLOYMENT", None) is not None:
        raise ConfigError(f"{path}: a DeepSeek-V4 deployment (DEPLOYMENT, no CONFIG): "
                          "`python -m jlco.plan` plans it; jlco.generate / jlco.serve run a "
                          "deepseek_v4 checkpoint (--checkpoint) or a config file defining "
                          "CONFIG (configs/deepseek_v4_tiny.py: random weights)")
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: must define CONFIG = jlco.config.Config(...)")
    if cfg.cache.storage == "file":
        check_storage_path(cfg.cache.storage_path, str(path))
    return cfg


def run_config_file(path: pathlib.Path):
    """Execute a python config file → its module; whatever goes wrong becomes one
    ConfigError naming the file (and the line, for an exception raised while it runs)."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"jlco_config_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except ConfigError as err:
        raise ConfigError(f"{path}{_config_line(err, path)}: {err}") from None
    except Exception as err:  # noqa: BLE001 - any failure of a user's file is bad input
        raise ConfigError(f"{path}{_config_line(err, path)}: {type(err).__name__}: "
                          f"{err}") from None
    return mod


def _config_line(err: BaseException, path: pathlib.Path) -> str:
    """':LINE' of the config file where `err` was raised (or its syntax error)."""
    if isinstance(err, SyntaxError) and err.lineno:
        return f":{err.lineno}"
    target = os.path.abspath(path)
    lines = [fr.lineno for fr in traceback.extract_tb(err.__traceback__)
             if os.path.abspath(fr.filename) == target]
    return f":{lines[-1]}" if lines else ""


def check_storage_path(storage_path: str | None, where: str = "config") -> pathlib.Path:
    """cache.storage_path for storage='file' (the memory-mapped latent pool's directory):
    an existing writable directory, or a path that can be created (its nearest existing
    ancestor is a writable directory). Raises ConfigError naming the field otherwise."""
    field = "cache.storage_path"
    if not storage_path:
        raise ConfigError(f"{where}: {field}={storage_path!r} is invalid: allowed a "
                          "directory path when cache.storage='file'")
    p = pathlib.Path(storage_path).expanduser().absolute()
    anchor = p
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    if anchor == p and not p.is_dir():
        raise ConfigError(f"{where}: {field}={storage_path!r} is invalid: it exists and is "
                          "not a directory; allowed a writable directory")
    if not anchor.is_dir() or not os.access(anchor, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {field}={storage_path!r} is invalid: {str(anchor)!r} "
                          "is not a writable directory; allowed a writable directory or a "
                          "path that can be created")
    return p


def parse_override(text: str) -> tuple[str, object]:
    """'section.field=value' → ('section__field', value); value is a Python literal when
    it parses as one (`true` / `false`, as YAML and JSON spell them, are booleans too),
    else the string."""
    key, sep, raw = text.partition("=")
    sec, dot, field = key.strip().partition(".")
    if not sep or not dot or not sec or not field:
        raise ValueError(f"--override={text!r} is invalid: allowed section.field=value, e.g. "
                         "engine.max_batch_size=8")
    raw = raw.strip()
    try:
        val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        val = {"true": True, "false": False}.get(raw.lower(), raw)
    return f"{sec}__{field}", val


def apply_overrides(cfg, overrides: list[str]):
    """The config with every --override applied, or a ValueError naming the bad one."""
    sections = {f.name: f for f in dataclasses.fields(Config) if dataclasses.is_dataclass(
        getattr(cfg, f.name))}
    kw = {}
    for text in overrides:
        key, val = parse_override(text)
        sec, field = key.split("__", 1)
        field = current_name(sec, field)
        if sec not in sections:
            raise ValueError(f"--override={text!r}: unknown section {sec!r}; allowed "
                             f"{', '.join(sorted(sections))}")
        names = [f.name for f in dataclasses.fields(getattr(cfg, sec))]
        if field not in names:
            raise ValueError(f"--override={text!r}: {sec} has no field {field!r}; allowed "
                             f"{', '.join(names)}")
        kw[f"{sec}__{field}"] = val
    return cfg.replace(**kw)
