"""One static, validated config tree: model / cache / engine / serve.

Every number has one home here. Named instances live in `configs/*.py`, each defining
a module-level `CONFIG`; `load_config(path)` reads one. Invalid values raise
`ConfigError` naming the field and what is allowed, at construction time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
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
        _check(self.factor >= 1.0, "model.rope_scaling.factor", self.factor, ">= 1.0")
        _positive(self, "model.rope_scaling", "original_max_position_embeddings")
        _check(self.beta_fast > self.beta_slow > 0, "model.rope_scaling.beta_fast",
               (self.beta_fast, self.beta_slow), "beta_fast > beta_slow > 0")


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

    def __post_init__(self):
        p = "model"
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
        _one_of(self, p, "dtype", ("bfloat16", "float32"))

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
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_scaling", "dtype", "indexer_fp8"}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        if "rope_theta" not in kw and isinstance(rs, Mapping) and "rope_theta" in rs:
            kw["rope_theta"] = rs["rope_theta"]
        if isinstance(rs, Mapping) and rs.get("rope_type", rs.get("type")) == "yarn":
            rs_names = {f.name for f in dataclasses.fields(RopeScaling)}
            kw["rope_scaling"] = RopeScaling(**{k: rs[k] for k in rs_names if k in rs})
        else:
            kw["rope_scaling"] = None
        kw.update(overrides)
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Where the MLA latent cache lives and how rows move (the seed's knob table).

    offload:           latent cache in host memory (True) or all on device (False).
    storage:           host memory kind for the latent pool, or "file" (memory-mapped
                       file under storage_path).
    kv_format:         latent row format: "fp8" (656-byte FlashMLA layout), "bf16" (1152 B),
                       or "f32" (unquantised f32 rows, for fp32 parity tests).
    page_size:         tokens per host page; pages have exactly one owning request.
    staging_capacity:  hot-buffer rows per request per layer (device). Must be at least
                       index_topk * (1 + num_draft_tokens); 0 means "that minimum".
    prefetch_window:   most rows prefetched ahead per request per layer per step.
    prefetch_threads:  host threads issuing prefetch transfers.
    eviction:          hot-buffer victim policy.
    fetch_path:        how misses reach the device ("auto" = measured default per backend).
    host_headroom:     fraction of extra host memory kept free (seed: at least 30 %).
    """
    offload: bool = False
    storage: str = "pinned_host"
    storage_path: str | None = None
    kv_format: str = "bf16"
    page_size: int = 64
    staging_capacity: int = 0
    prefetch_window: int = 256
    prefetch_threads: int = 2
    eviction: str = "lru"
    fetch_path: str = "auto"
    host_headroom: float = 0.3
    indexer_key_format: str = "bf16"

    def __post_init__(self):
        p = "cache"
        _one_of(self, p, "storage", ("pinned_host", "unpinned_host", "file"))
        _check(self.storage != "file" or bool(self.storage_path), f"{p}.storage_path",
               self.storage_path, "a directory path when cache.storage='file'")
        _one_of(self, p, "kv_format", ("bf16", "f32", "fp8"))
        _one_of(self, p, "eviction", ("lru", "fifo"))
        _one_of(self, p, "fetch_path", ("auto", "in_jit", "host_driven"))
        _one_of(self, p, "indexer_key_format", ("bf16", "fp8"))
        _positive(self, p, "page_size", "prefetch_threads")
        _check(isinstance(self.staging_capacity, int) and self.staging_capacity >= 0,
               f"{p}.staging_capacity", self.staging_capacity, "an integer >= 0 (0 = minimum)")
        _check(isinstance(self.prefetch_window, int) and self.prefetch_window >= 0,
               f"{p}.prefetch_window", self.prefetch_window, "an integer >= 0")
        _check(0.3 <= self.host_headroom <= 4.0, f"{p}.host_headroom", self.host_headroom,
               "0.3..4.0 (the seed asks for at least 30 % headroom)")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Batching and step shape.

    max_batch_size:     requests decoded together.
    max_context_len:    longest prompt + generation per request, in tokens.
    prefill_chunk:      prompt tokens per prefill chunk (bounds the [chunk, L] score matrix).
    num_draft_tokens:   MTP draft tokens per step (0 = no speculation); s_q = 1 + this.
    attention_impl:     "auto" picks the Pallas kernel for the platform being lowered for,
                        "xla" forces the plain-jnp fallback, "pallas" requires the kernel.
    """
    max_batch_size: int = 1
    max_context_len: int = 4096
    prefill_chunk: int = 512
    num_draft_tokens: int = 0
    attention_impl: str = "auto"
    seed: int = 0

    def __post_init__(self):
        p = "engine"
        _positive(self, p, "max_batch_size", "max_context_len", "prefill_chunk")
        _check(isinstance(self.num_draft_tokens, int) and 0 <= self.num_draft_tokens <= 7,
               f"{p}.num_draft_tokens", self.num_draft_tokens, "an integer in 0..7")
        _one_of(self, p, "attention_impl", ("auto", "xla", "pallas"))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """HTTP serving and admission watermarks (fractions of each memory pool)."""
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    high_watermark: float = 0.9
    low_watermark: float = 0.75

    def __post_init__(self):
        p = "serve"
        _check(isinstance(self.port, int) and 0 <= self.port <= 65535, f"{p}.port",
               self.port, "0..65535")
        _positive(self, p, "max_queue")
        _check(0 < self.low_watermark < self.high_watermark <= 1.0, f"{p}.high_watermark",
               (self.low_watermark, self.high_watermark), "0 < low_watermark < high_watermark <= 1")


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    engine: EngineConfig = EngineConfig()
    serve: ServeConfig = ServeConfig()
    name: str = "unnamed"

    def __post_init__(self):
        m, c, e = self.model, self.cache, self.engine
        _check(e.max_context_len <= m.max_position_embeddings, "engine.max_context_len",
               e.max_context_len, f"<= model.max_position_embeddings ({m.max_position_embeddings})")
        _check(e.num_draft_tokens == 0 or m.num_nextn_predict_layers > 0,
               "engine.num_draft_tokens", e.num_draft_tokens,
               "0 when the model has no MTP layer (model.num_nextn_predict_layers=0)")
        _check(c.kv_format != "fp8" or m.kv_lora_rank % 128 == 0, "cache.kv_format", c.kv_format,
               f"'bf16' unless model.kv_lora_rank ({m.kv_lora_rank}) is a multiple of 128")
        if c.offload and c.staging_capacity:
            _check(c.staging_capacity >= self.min_staging_capacity, "cache.staging_capacity",
                   c.staging_capacity, f">= index_topk * (1 + num_draft_tokens) = "
                   f"{self.min_staging_capacity} (or 0 for that minimum)")

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
    def min_staging_capacity(self) -> int:
        return self.model.index_topk * (1 + self.engine.num_draft_tokens)

    @property
    def staging_capacity(self) -> int:
        """Hot-buffer rows per request per layer, with 0 resolved to the minimum."""
        return self.cache.staging_capacity or self.min_staging_capacity

    def replace(self, **sections: Any) -> "Config":
        """Copy with whole sections or `section__field=value` overrides replaced. A
        section's overrides apply together, so fields that are only valid jointly
        (cache__storage='file' with cache__storage_path) can be set in one call."""
        kw: dict[str, Any] = {}
        per_section: dict[str, dict[str, Any]] = {}
        for key, val in sections.items():
            if "__" in key:
                sec, field = key.split("__", 1)
                per_section.setdefault(sec, {})[field] = val
            else:
                kw[key] = val
        for sec, fields in per_section.items():
            kw[sec] = dataclasses.replace(kw.get(sec, getattr(self, sec)), **fields)
        return dataclasses.replace(self, **kw)


def load_config(path: str | pathlib.Path) -> Config:
    """Execute a python config file and return its module-level `CONFIG`."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"jlco_config_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = getattr(mod, "CONFIG", None)
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: must define CONFIG = jlco.config.Config(...)")
    return cfg
