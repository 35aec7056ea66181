"""Memory plan for DeepSeek-V4 (`model_type` deepseek_v4): weights per device, cache bytes
per request per layer type, the largest batch with and without offload.

V4's cache is not one latent row per token and layer (docs/facts.md §7, and what
`jlco.model.deepseek_v4.state.init_state` allocates per request):
  every layer      the sliding window: W rows of head_dim D (K = V), whatever the context;
  CSA layers       one compressed entry [D] per m tokens (m = compress_rate_csa), the
                   indexer's key [D_I] per m tokens, and the compressor's open-window
                   buffers and overlap carry;
  HCA layers       one entry [D] per m' tokens (m' = compress_rate_hca), attended densely,
                   and the open-window buffers.
Offload moves CSA's compressed entries — the rows the lightning indexer selects — to the
host pool, with a hot buffer of `hot_rows` entries per CSA layer and request in front
(default: index_topk × s_q, the engine's minimum); HCA entries, the window, the carries
and the indexer's keys stay on the device (every step reads all of them).

Weights are counted from the shapes `jlco.model.deepseek_v4.model.DeepseekV4` declares
(`param_counts`; a test checks the count against the model's own parameters), plus the
MTP layer the checkpoint ships (one more decoder layer, `e_proj` / `h_proj` and their
norms). Storage (`V4_WEIGHT_FORMATS`): `official` is the released checkpoints' mix —
routed experts FP4 (e2m1, one e8m0 scale per 32 values), the other projections FP8
(e4m3, one scale per 128 × 128 block), the compressors, indexer, hyper-connections,
embedding, head and norms bf16; `fp8` and `bf16` put every matrix in one format.

Cache values are stored in the model's dtype, as the engine's state holds them (bf16:
transformers has no fp8 KV format for V4, docs/facts.md §7); the compressors' gates f32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jlco.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from jlco.planning.hardware import HardwareProfile
from jlco.model.layers import dtype_of
from jlco.planning.mesh import MeshShape, host_layout

V4_WEIGHT_FORMATS = ("official", "fp8", "bf16")
_SLOT_TABLE_BYTES = 9   # per hot-buffer row and CSA layer: int32 position + stamp, bool flag


@dataclasses.dataclass(frozen=True)
class V4Deployment:
    """A DeepSeek-V4 deployment to plan: the architecture and the serving choices.
    configs/deepseek_v4_flash.py and configs/deepseek_v4_pro.py define one as
    `DEPLOYMENT`."""
    name: str
    model: V4Config
    max_context_len: int = 131072
    max_batch_size: int = 256
    num_draft_tokens: int = 1
    hot_buffer_rows: int = 0          # per CSA layer and request; 0 = index_topk × s_q
    host_headroom: float = 0.3        # host pool slack, as cache.host_headroom

    def __post_init__(self):
        for name in ("max_context_len", "max_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{self.name}: {name}={v!r} is invalid: allowed a positive "
                                 "integer")
        if not isinstance(self.model, V4Config):
            raise ValueError(f"{self.name}: model={type(self.model).__name__} is invalid: "
                             "allowed a jlco.model.deepseek_v4.config.V4Config")
        d = self.num_draft_tokens
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"{self.name}: num_draft_tokens={d!r} is invalid: allowed an "
                             "integer >= 0")
        if d and not self.model.num_nextn_predict_layers:
            raise ValueError(f"{self.name}: num_draft_tokens={d} is invalid: allowed 0 (the "
                             "model has no MTP layer)")
        if self.max_context_len > self.model.max_position_embeddings:
            raise ValueError(f"{self.name}: max_context_len={self.max_context_len} is invalid: "
                             f"allowed <= model.max_position_embeddings "
                             f"({self.model.max_position_embeddings})")
        if not self.host_headroom >= 0:
            raise ValueError(f"{self.name}: host_headroom={self.host_headroom!r} is invalid: "
                             "allowed >= 0")
        if self.hot_buffer_rows and self.hot_buffer_rows < self.min_hot_rows:
            raise ValueError(f"{self.name}: hot_buffer_rows={self.hot_buffer_rows} is invalid: "
                             f"allowed >= index_topk x (1 + num_draft_tokens) = "
                             f"{self.min_hot_rows}, or 0 for that minimum")

    @property
    def s_q(self) -> int:
        return 1 + self.num_draft_tokens

    @property
    def min_hot_rows(self) -> int:
        return self.model.index_topk * self.s_q

    @property
    def hot_rows(self) -> int:
        return self.hot_buffer_rows or self.min_hot_rows


def layer_counts(m: V4Config) -> dict[str, int]:
    return {k: sum(t == k for t in m.layer_types) for k in (SLIDING, CSA, HCA)}


def _compressor(m: V4Config, width: int, rate: int, overlap: bool) -> int:
    o = 2 * width if overlap else width
    return rate * o + 2 * m.hidden_size * o + width          # ape, wkv + wgate, norm


def param_counts(m: V4Config) -> dict[str, int]:
    """Parameters by group, as `DeepseekV4` declares them (per model, all layers)."""
    d, h, D, n = m.hidden_size, m.num_attention_heads, m.head_dim, m.hc_mult
    attn_mats = (d * m.q_lora_rank + m.q_lora_rank * h * D + d * D + h * D * m.o_lora_rank
                 + m.o_groups * m.o_lora_rank * d)
    attn_small = h + m.q_lora_rank + D + 2 * d                 # sink, q_norm, kv norm, 2 norms
    hc = 2 * ((2 + n) * n * (n * d + 1) + 3)                    # hc_attn, hc_ffn: fn, base, scale
    out = dict(attention=0, attention_small=0, compressors=0, indexer=0, hyper=0,
               routed_experts=0, shared_experts=0, router=0)
    for i, kind in enumerate(m.layer_types):
        out["attention"] += attn_mats
        out["attention_small"] += attn_small
        out["hyper"] += hc
        rate = m.compress_rate(i)
        if rate:
            out["compressors"] += _compressor(m, D, rate, kind == CSA)
        if kind == CSA:
            out["indexer"] += (_compressor(m, m.index_head_dim, rate, True)
                               + m.q_lora_rank * m.index_n_heads * m.index_head_dim
                               + d * m.index_n_heads)
        out["routed_experts"] += 3 * m.n_routed_experts * d * m.moe_intermediate_size
        out["shared_experts"] += 3 * d * m.moe_intermediate_size
        out["router"] += d * m.n_routed_experts + (m.mlp_layer_types[i] == "moe") \
            * m.n_routed_experts
    out["embed"] = m.vocab_size * d
    out["head"] = m.vocab_size * d
    out["hyper"] += n * (n * d + 1) + 1 + d                     # hc_head, final norm
    return out


def mtp_params(m: V4Config) -> int:
    """One MTP layer as the checkpoint ships it: a decoder layer (CSA attention, routed
    MoE) plus e_proj / h_proj [d, d] and their norms; it shares embedding and head."""
    if not m.num_nextn_predict_layers:
        return 0
    one = dataclasses.replace(m, num_hidden_layers=1, layer_types=(CSA,),
                              mlp_layer_types=("moe",))
    c = param_counts(one)
    layer = sum(v for k, v in c.items() if k not in ("embed", "head"))
    return m.num_nextn_predict_layers * (layer + 2 * m.hidden_size ** 2 + 3 * m.hidden_size)


def hash_table_bytes(m: V4Config) -> int:
    """hash_moe layers' frozen token → experts tables (int32 [vocab, k] each)."""
    return 4 * m.vocab_size * m.num_experts_per_tok * sum(
        t == "hash_moe" for t in m.mlp_layer_types)


def _bytes_per_param(group: str, fmt: str) -> float:
    """Storage bytes per parameter of a group in a weight format (scales included)."""
    if fmt == "bf16":
        return 2.0
    fp8 = 1.0 + 1.0 / (128 * 128)                  # e4m3 + one e8m0 scale per block
    if fmt == "fp8":
        return fp8 if group in ("attention", "routed_experts", "shared_experts") else 2.0
    # official: routed experts fp4 (two values per byte + a scale per 32), matrices fp8
    return {"routed_experts": 0.5 + 1.0 / 32, "attention": fp8, "shared_experts": fp8}.get(
        group, 2.0)


@dataclasses.dataclass(frozen=True)
class V4Weights:
    params_total: int         # the model's, MTP layer included
    params_active: int        # per token, main model: all but unrouted experts, embedding, MTP
    bytes_total: float        # the whole model in the format
    bytes_device: float       # one device's share (routed experts split over expert ranks)
    routed_experts_device: float
    fmt: str


def weights(m: V4Config, fmt: str, expert: int = 1) -> V4Weights:
    if fmt not in V4_WEIGHT_FORMATS:
        raise ValueError(f"weight_format={fmt!r} is invalid: allowed one of "
                         + ", ".join(V4_WEIGHT_FORMATS))
    c = param_counts(m)
    mtp = mtp_params(m)
    routed_mtp = 3 * m.n_routed_experts * m.hidden_size * m.moe_intermediate_size \
        * m.num_nextn_predict_layers
    total = sum(c.values()) + mtp
    # per token of the main model (the MTP layer runs only when drafting)
    active = (total - mtp - c["routed_experts"] - c["embed"]
              + c["routed_experts"] * m.num_experts_per_tok // m.n_routed_experts)
    by = {g: v * _bytes_per_param(g, fmt) for g, v in c.items()}
    by["mtp"] = (mtp - routed_mtp) * _bytes_per_param("attention", fmt)
    by["routed_experts"] += routed_mtp * _bytes_per_param("routed_experts", fmt)
    whole = sum(by.values()) + hash_table_bytes(m)
    routed_dev = by["routed_experts"] / expert
    return V4Weights(total, active, whole, whole - by["routed_experts"] + routed_dev,
                     routed_dev, fmt)


def _layer_parts(m: V4Config, context: int) -> dict[str, dict[str, int]]:
    """Bytes of one request's state per layer of each type, by part, from the shapes
    `init_state` allocates (so the plan cannot drift from the engine's state)."""
    import jax
    from jlco.model.deepseek_v4.state import init_state
    shapes = jax.eval_shape(lambda: init_state(m, 1, context))
    out: dict[str, dict[str, int]] = {}
    for kind, st in zip(m.layer_types, shapes["layers"]):
        if kind in out:
            continue
        parts = dict(window=st["window"].size * st["window"].dtype.itemsize, entries=0,
                     indexer_keys=0, carry=0)
        for sub, key in (("comp", "entries"), ("index", "indexer_keys")):
            for name, leaf in st.get(sub, {}).items():
                parts[key if name == "entries" else "carry"] += leaf.size * leaf.dtype.itemsize
        out[kind] = parts
    return out


def per_request_bytes(dep: V4Deployment, context: int, offload: bool) -> dict:
    """Device and host bytes one request holds, per layer of each type and summed over
    the model's layers, plus the hot buffer and its slot tables when offloaded (CSA's
    entries then live in the host pool)."""
    m = dep.model
    row = m.head_dim * np.dtype(dtype_of(m)).itemsize
    kinds = {}
    for kind, parts in _layer_parts(m, context).items():
        off = offload and kind == CSA
        v = dict(window=parts["window"], entries_device=0 if off else parts["entries"],
                 hot_buffer=dep.hot_rows * (row + _SLOT_TABLE_BYTES) if off else 0,
                 indexer_keys=parts["indexer_keys"], carry=parts["carry"],
                 host=parts["entries"] if off else 0)
        v["device"] = sum(v[k] for k in ("window", "entries_device", "hot_buffer",
                                         "indexer_keys", "carry"))
        kinds[kind] = v
    n = layer_counts(m)
    return dict(per_layer=kinds, layers=n,
                device=sum(n[k] * v["device"] for k, v in kinds.items()),
                host=sum(n[k] * v["host"] for k, v in kinds.items()),
                activations=dep.s_q * activation_bytes_per_token(m, context))


def activation_bytes_per_token(m: V4Config, context: int) -> int:
    """Live activation bytes per query token: the hc_mult residual streams (bf16, twice)
    plus the largest transient of a layer: the indexer's f32 scores over the CSA entries,
    the attention logits over window + top-k + HCA entries, the MoE's expert hiddens, or
    the f32 vocabulary logits."""
    streams = 2 * 2 * m.hc_mult * m.hidden_size
    indexer = 4 * (context // m.compress_rate_csa) + 2 * m.index_n_heads * m.index_head_dim
    attend = 4 * m.num_attention_heads * (m.sliding_window + m.index_topk
                                          + context // m.compress_rate_hca)
    moe = m.num_experts_per_tok * (3 * m.hidden_size + 4 * m.moe_intermediate_size)
    return streams + max(indexer, attend, moe, 4 * m.vocab_size)


@dataclasses.dataclass(frozen=True)
class V4Plan:
    deployment: str
    hardware: str
    mesh: dict
    context: int
    s_q: int
    device_bytes: float
    reserve_bytes: float
    weights: V4Weights
    per_request_offload: dict
    per_request_no_offload: dict
    max_batch_offload: int
    max_batch_no_offload: int
    batch_cap: int
    hot_rows: int
    host_bytes_per_device: float
    host_bytes_per_host: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def max_batch(dep: V4Deployment, free_bytes: float, context: int, offload: bool) -> int:
    pr = per_request_bytes(dep, context, offload)
    return max(0, int(free_bytes // (pr["device"] + pr["activations"])))


def plan(dep: V4Deployment, hw: HardwareProfile, *, mesh: MeshShape | None = None,
         context: int | None = None, weight_format: str = "official",
         reserve_bytes: float | None = None, devices_per_host: int = 8) -> V4Plan:
    """The plan for one `hw` device of `mesh` (default data=1, expert=1, tensor=1;
    tensor parallelism is not modelled for V4 and is refused)."""
    mesh = mesh or MeshShape()
    if mesh.tensor != 1:
        raise ValueError(f"mesh tensor={mesh.tensor} is invalid for deepseek_v4: allowed 1 "
                         "(the V4 plan models expert and data parallelism only)")
    context = dep.max_context_len if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} is invalid: allowed a positive integer")
    reserve = hw.runtime_reserve_gb.value * 1e9 if reserve_bytes is None else reserve_bytes
    if not reserve >= 0:
        raise ValueError(f"reserve_bytes={reserve!r} is invalid: allowed >= 0")
    w = weights(dep.model, weight_format, mesh.expert)
    free = hw.hbm_bytes - reserve - w.bytes_device
    b_off = max_batch(dep, free, context, True)
    b_dev = max_batch(dep, free, context, False)
    pr_off = per_request_bytes(dep, context, True)
    layout = host_layout(mesh, devices_per_host)
    host_dev = min(b_off, dep.max_batch_size) * pr_off["host"] * (1 + dep.host_headroom)
    return V4Plan(dep.name, hw.name, mesh.as_dict(), context, dep.s_q, hw.hbm_bytes, reserve,
                  w, pr_off, per_request_bytes(dep, context, False), b_off, b_dev,
                  dep.max_batch_size, dep.hot_rows, host_dev,
                  host_dev * layout.attention_ranks_per_host)


def _gb(x: float) -> str:
    return f"{x / 1e9:9.2f} GB"


def _mb(x: float) -> str:
    return f"{x / 2**20:9.2f} MiB"


def load_deployment(path) -> V4Deployment | None:
    """The `DEPLOYMENT` a config file defines (None when it defines none); any error
    while the file runs is a ConfigError naming the file."""
    import pathlib
    from jlco.config import ConfigError, run_config_file
    dep = getattr(run_config_file(pathlib.Path(path)), "DEPLOYMENT", None)
    if dep is not None and not isinstance(dep, V4Deployment):
        raise ConfigError(f"{path}: DEPLOYMENT must be a jlco.planning.v4.V4Deployment")
    return dep


_SHORT = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


def format_table(p: V4Plan) -> str:
    w, m = p.weights, p.mesh
    rows = [f"plan: {p.deployment} (deepseek_v4) on {p.hardware}, mesh data={m['data']} "
            f"expert={m['expert']}, context {p.context}, s_q {p.s_q}; per device",
            f"device memory          {_gb(p.device_bytes)}",
            f"weights per device     {_gb(w.bytes_device)}  ({w.fmt}; {w.params_total / 1e9:.1f}"
            f" B params, {w.params_active / 1e9:.1f} B active; routed experts "
            f"{_gb(w.routed_experts_device)})",
            f"runtime reserve        {_gb(p.reserve_bytes)}",
            "per request and layer   " + "".join(f"{h:>13}" for h in (
                "window", "entries", "hot buffer", "index keys", "carry", "device", "host")),
            "  (entries: offload off; the rest offload on)"]
    for kind, v in p.per_request_offload["per_layer"].items():
        n = p.per_request_offload["layers"][kind]
        if not n:
            continue
        off = p.per_request_no_offload["per_layer"][kind]
        cells = (v["window"], off["entries_device"], v["hot_buffer"], v["indexer_keys"],
                 v["carry"], v["device"], v["host"])
        rows.append(f"  {_SHORT[kind]:<8} x {n:<3} layers " + "".join(_mb(c) for c in cells))
    for name, pr in (("offload", p.per_request_offload), ("no offload", p.per_request_no_offload)):
        rows.append(f"per request, {name:<10} device {_gb(pr['device'])}  activations "
                    f"{_gb(pr['activations'])}  host {_gb(pr['host'])}")
    rows += [f"hot buffer             {p.hot_rows} entries per CSA layer and request",
             f"largest batch, offload    {p.max_batch_offload:6d} (memory) -> admitted "
             f"{min(p.max_batch_offload, p.batch_cap)} (max_batch_size {p.batch_cap})",
             f"largest batch, no offload {p.max_batch_no_offload:6d} (memory) -> admitted "
             f"{min(p.max_batch_no_offload, p.batch_cap)}",
             f"host pool per device   {_gb(p.host_bytes_per_device)}; per host "
             f"{_gb(p.host_bytes_per_host)} (with headroom)"]
    if p.max_batch_no_offload:
        rows.append(f"offload / no offload: x{p.max_batch_offload / p.max_batch_no_offload:.2f}"
                    " requests per device")
    return "\n".join(rows)


def cache_bytes_per_token(dep: V4Deployment, context: int = 1 << 20) -> float:
    """All layers' cache bytes per token of context (window and carries amortised over
    `context`), offload off: the figure to set beside V3.2's 656 B x 61 layers."""
    pr = per_request_bytes(dep, context, False)
    return pr["device"] / context


def v3_2_bytes_per_token() -> int:
    """DeepSeek-V3.2's, at fp8 latent rows (656 B) + fp8 indexer keys (132 B), 61 layers."""
    return 61 * (656 + 132)

