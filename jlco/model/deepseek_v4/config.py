"""The DeepSeek-V4 architecture (`V4Config`) and its config.json reader.

V4 shares little of ModelConfig's shape (no MLA latent, no dense layers, one KV head of
head_dim, compressors), so it has a dataclass of its own; `jlco.config.ModelConfig`
refuses model_type deepseek_v4. `V4Config.from_hf_dict` reads config.json as
transformers' DeepseekV4Config does (docs/facts.md §7), with its backward-compatible
spellings: `compress_ratios` (per-layer 0 / 4 / 128) for `layer_types`,
`compress_rate_csa` / `compress_rate_hca` for `compress_rates`, `num_hash_layers` for
`mlp_layer_types`, `qk_rope_head_dim` for `partial_rotary_factor`, a flat or legacy
`rope_scaling` for the "compress" RoPE. Fields that decide a weight's shape, the layer
schedule or the arithmetic are required (`V4_REQUIRED`); values jlco does not implement
are refused naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jlco.config import (
    DTYPES,
    ConfigError,
    ModelArchitecture,
    RopeScaling,
    _check,
    _check_types,
    _one_of,
    _positive,
)

MODEL_TYPE = "deepseek_v4"
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")
# The legacy `compress_ratios` integers are labels of a layer type (transformers'
# _COMPRESS_RATIO_TO_LAYER_TYPE); the rates themselves come from compress_rates.
_RATIO_LABELS = {0: SLIDING, 4: CSA, 128: HCA}


@dataclasses.dataclass(frozen=True)
class V4Config(ModelArchitecture):
    """Architecture of a DeepSeek-V4 model. Defaults: transformers' DeepseekV4Config
    defaults (documented as DeepSeek-V4-Flash-Base's)."""
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple = ()                 # () = transformers' default schedule
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    mlp_layer_types: tuple = ()             # () = 3 hash_moe layers, then moe
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0             # "main" RoPE: sliding_attention layers
    compress_rope_theta: float = 160000.0   # "compress" RoPE: CSA / HCA layers
    rope_scaling: RopeScaling | None = None  # YaRN of the "compress" RoPE
    rope_attention_factor: float = 1.0      # cos/sin scale of a YaRN "compress" RoPE
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    model_type: str = MODEL_TYPE

    def __post_init__(self):
        p = "model"
        n = self.num_hidden_layers if isinstance(self.num_hidden_layers, int) else 0
        for name, default in (("layer_types", default_layer_types(n)),
                              ("mlp_layer_types", default_mlp_layer_types(n, 3))):
            v = getattr(self, name)
            if isinstance(v, list):
                v = tuple(v)
            object.__setattr__(self, name, v if v else tuple(default))
        _check_types(self, p)
        _positive(self, p, "vocab_size", "hidden_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
                  "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                  "compress_rate_csa", "compress_rate_hca", "index_n_heads", "index_head_dim",
                  "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                  "num_experts_per_tok", "max_position_embeddings")
        self._check_shapes(p)
        for name in ("hc_eps", "rms_norm_eps", "routed_scaling_factor", "swiglu_limit",
                     "rope_theta", "compress_rope_theta", "rope_attention_factor"):
            _check(getattr(self, name) > 0, f"{p}.{name}", getattr(self, name), "> 0")
        _check(self.num_nextn_predict_layers >= 0, f"{p}.num_nextn_predict_layers",
               self.num_nextn_predict_layers, ">= 0")
        _one_of(self, p, "scoring_func", SCORING_FUNCS)
        _one_of(self, p, "dtype", DTYPES)
        _one_of(self, p, "model_type", (MODEL_TYPE,))
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            v = getattr(self, name)
            _check(len(v) == self.num_hidden_layers and all(t in allowed for t in v),
                   f"{p}.{name}", v, f"{self.num_hidden_layers} entries (num_hidden_layers), "
                   "each one of " + ", ".join(map(repr, allowed)))

    def _check_shapes(self, p: str) -> None:
        r = self.qk_rope_head_dim
        _check(r % 2 == 0 and r <= self.head_dim, f"{p}.qk_rope_head_dim", r,
               f"an even number <= head_dim ({self.head_dim})")
        _check(r <= self.index_head_dim, f"{p}.index_head_dim", self.index_head_dim,
               f">= qk_rope_head_dim ({r})")
        _check(self.num_attention_heads % self.o_groups == 0, f"{p}.o_groups", self.o_groups,
               f"a divisor of num_attention_heads ({self.num_attention_heads})")
        _check(self.num_experts_per_tok <= self.n_routed_experts, f"{p}.num_experts_per_tok",
               self.num_experts_per_tok, f"<= n_routed_experts ({self.n_routed_experts})")

    def compress_rate(self, layer: int) -> int:
        """Tokens pooled into one compressed entry at `layer` (0: sliding only)."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[kind]

    @property
    def dense_layers(self) -> int:
        """V4 has no dense-MLP layers (every layer is MoE); the planner reads this."""
        return 0

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> "V4Config":
        """Build from a config.json dict (`model_type` deepseek_v4), as DeepseekV4Config
        reads it; unknown keys are ignored, as transformers ignores them."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        _check(d.get("model_type") == MODEL_TYPE, "config.json field 'model_type'",
               d.get("model_type"), repr(MODEL_TYPE))
        _refuse_unimplemented(d)
        missing = [k for k in V4_REQUIRED if d.get(k) is None]
        missing += [" or ".join(map(repr, alts)) for alts in _V4_REQUIRED_ONE_OF
                    if all(d.get(k) is None for k in alts)]
        if missing:
            raise ConfigError("config.json is missing required field(s) "
                              + ", ".join(m if " or " in m else repr(m) for m in missing)
                              + ": each must be set (no default: V4-Flash's value would be "
                              "used silently)")
        names = {f.name for f in dataclasses.fields(cls)} - {
            "layer_types", "mlp_layer_types", "rope_scaling", "rope_attention_factor", "dtype",
            "model_type", "qk_rope_head_dim", "compress_rate_csa", "compress_rate_hca"}
        kw: dict[str, Any] = {k: d[k] for k in names if d.get(k) is not None}
        n = d["num_hidden_layers"]
        kw["qk_rope_head_dim"] = _rope_dims(d)
        kw.update(_compress_rates(d))
        kw["layer_types"] = tuple(_layer_types(d, n))
        kw["mlp_layer_types"] = tuple(_mlp_layer_types(d, n))
        kw.update(_compress_rope(d))
        kw.update(overrides)
        return cls(**kw)


# Fields whose absence would silently give V4-Flash's value to a weight shape, the layer
# schedule or the arithmetic. transformers' save_pretrained writes every one of them.
V4_REQUIRED = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
    "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "rms_norm_eps")
_V4_REQUIRED_ONE_OF = (("layer_types", "compress_ratios"),
                       ("mlp_layer_types", "num_hash_layers"),
                       ("qk_rope_head_dim", "partial_rotary_factor"))


def _refuse_unimplemented(d: Mapping[str, Any]) -> None:
    for key, want in (("hidden_act", "silu"), ("mlp_bias", False)):
        if d.get(key, want) != want:
            raise ConfigError(f"config.json field {key!r}={d[key]!r} is invalid: allowed "
                              f"{want!r} (the only value jlco implements for deepseek_v4)")
    q = d.get("quantization_config")
    if q is not None:
        _check(isinstance(q, Mapping), "config.json field 'quantization_config'", q,
               "a JSON object or null")
        for key, allowed in (("quant_method", ("fp8",)), ("fmt", ("e4m3", None)),
                             ("scale_fmt", ("ue8m0", None)),
                             ("expert_dtype", ("fp4", "fp8", None))):
            _check(q.get(key) in allowed, f"config.json field 'quantization_config.{key}'",
                   q.get(key), " or ".join(repr(a) for a in allowed if a is not None)
                   + " (the block formats jlco dequantises at load)")
    _check(d.get("expert_dtype") in ("fp4", "fp8", None), "config.json field 'expert_dtype'",
           d.get("expert_dtype"), "'fp4' or 'fp8'")


def _int_field(d: Mapping[str, Any], key: str) -> int:
    v = d[key]
    _check(isinstance(v, int) and not isinstance(v, bool), f"config.json field {key!r}", v,
           "an integer")
    return v


def _rope_dims(d: Mapping[str, Any]) -> int:
    """qk_rope_head_dim, else int(head_dim * partial_rotary_factor) (transformers'
    order: the legacy key wins, and both are written back on save)."""
    if d.get("qk_rope_head_dim") is not None:
        return _int_field(d, "qk_rope_head_dim")
    f = d["partial_rotary_factor"]
    _check(isinstance(f, (int, float)) and 0 < f <= 1, "config.json field "
           "'partial_rotary_factor'", f, "a number in (0, 1]")
    return int(_int_field(d, "head_dim") * f)


def _compress_rates(d: Mapping[str, Any]) -> dict[str, int]:
    rates = d.get("compress_rates")
    if rates is None:
        rates = {}
    _check(isinstance(rates, Mapping) and set(rates) <= {CSA, HCA},
           "config.json field 'compress_rates'", rates, f"an object with keys {CSA!r}, {HCA!r}")
    out = {"compress_rate_csa": rates.get(CSA, 4), "compress_rate_hca": rates.get(HCA, 128)}
    for key in ("compress_rate_csa", "compress_rate_hca"):
        if d.get(key) is not None:
            out[key] = d[key]
    return out


def _layer_types(d: Mapping[str, Any], n: int) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        ratios = d["compress_ratios"]
        _check(isinstance(ratios, list) and all(r in _RATIO_LABELS for r in ratios),
               "config.json field 'compress_ratios'", ratios,
               "a list of " + ", ".join(map(str, _RATIO_LABELS)))
        types = [_RATIO_LABELS[r] for r in ratios]
    _check(isinstance(types, list) and len(types) >= n and all(t in LAYER_TYPES for t in types),
           "config.json field 'layer_types'", types, f"a list of >= num_hidden_layers ({n}) "
           "entries, each one of " + ", ".join(map(repr, LAYER_TYPES)))
    return types[:n]


def _mlp_layer_types(d: Mapping[str, Any], n: int) -> list[str]:
    types = d.get("mlp_layer_types")
    if types is None:
        return default_mlp_layer_types(n, _int_field(d, "num_hash_layers"))
    _check(isinstance(types, list) and len(types) >= n
           and all(t in MLP_LAYER_TYPES for t in types), "config.json field 'mlp_layer_types'",
           types, f"a list of >= num_hidden_layers ({n}) entries, each one of "
           + ", ".join(map(repr, MLP_LAYER_TYPES)))
    return types[:n]


def _compress_rope(d: Mapping[str, Any]) -> dict[str, Any]:
    """The "compress" RoPE's YaRN (the "main" one is always plain): a nested
    rope_parameters["compress"], else a flat rope_parameters / legacy rope_scaling."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    _check(isinstance(rp, Mapping), f"config.json field {key!r}", rp, "a JSON object or null")
    out: dict[str, Any] = {}
    if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        main = rp["main"]
        _check(main.get("rope_type", main.get("type", "default")) == "default",
               f"config.json field '{key}.main.rope_type'", main.get("rope_type"), "'default'")
        if main.get("rope_theta") is not None:
            out["rope_theta"] = main["rope_theta"]
        rp, key = rp["compress"], f"{key}.compress"
        if rp.get("rope_theta") is not None:
            out["compress_rope_theta"] = rp["rope_theta"]
    kind = rp.get("rope_type", rp.get("type", "default"))
    _check(kind in ("default", "yarn"), f"config.json field '{key}.rope_type'", kind,
           "'default' or 'yarn'")
    if kind == "yarn":
        _check(rp.get("truncate", True) is True, f"config.json field '{key}.truncate'",
               rp.get("truncate"), "true (jlco floors / ceils the YaRN ramp)")
        for k in ("factor", "original_max_position_embeddings"):
            _check(rp.get(k) is not None, f"config.json field '{key}.{k}'", None, "a number")
        names = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
        out["rope_scaling"] = RopeScaling(**{k: rp[k] for k in names if rp.get(k) is not None})
        out["rope_attention_factor"] = float(rp.get("attention_factor") or 1.0)
    return out


def default_layer_types(n: int) -> list[str]:
    """transformers' default schedule: two HCA layers, then HCA / CSA alternating."""
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def default_mlp_layer_types(n: int, hash_layers: int) -> list[str]:
    return ["hash_moe"] * min(n, hash_layers) + ["moe"] * max(0, n - hash_layers)
