"""Memory planner: how many requests fit on one device, with and without offload.

Device = weights on this device + runtime reserve + activations + per-request caches. Per
request, the indexer cache always stays on device (every step scores every token); the
latent cache is either all on device (offload off) or only its hot buffer is (offload
on, the rest in host memory). The largest batch is the memory limit, and the admitted
batch is that capped by `engine.max_batch_size`; both are reported. The transfer check
asks whether one step's missed rows cross the host link within one step's compute.

Mesh (`jlco.planning.mesh`): the weights are this device's share of a (data, expert,
tensor) mesh; the batch is per device, i.e. the requests of its attention rank; the host
pool is per host (the latent caches of the attention ranks on that host).

Hot buffer: an explicit `cache.hot_buffer_rows` is planned as given (what the engine
allocates). At 0 ("the minimum") the plan sizes it from the union of the s_q query
tokens' top-k sets (`jlco.planning.mtp.union_rows`), not top-k × s_q; the batch the
engine's current top-k × s_q minimum allows is reported beside it.

`python -m jlco.plan --config configs/128k.py --hardware h200 [--mesh data=8,expert=8]`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jlco.config import Config
from jlco.model import kv_cache
from jlco.planning import mtp
from jlco.planning import throughput as sim
from jlco.planning.hardware import HardwareProfile
from jlco.planning.mesh import MeshShape, host_layout
from jlco.planning.params import WeightBytes, weight_bytes
from jlco.util.sampling_tables import penalty_table_bytes


def cache_layers(cfg: Config) -> int:
    """Layers that keep a cache: the main layers plus the MTP layer when the model has
    one, as `jlco.model.kv_cache` and the engine allocate it (also when not drafting)."""
    return kv_cache.cache_layers(cfg)


def activation_bytes_per_token(cfg: Config, context: int) -> int:
    """Peak live activation bytes per query token: residual + normed input (bf16) plus
    the largest transient of one layer: f32 indexer logits over the context, MoE
    dispatch/combine buffers and expert hiddens, or f32 vocabulary logits."""
    m = cfg.model
    base = 2 * 2 * m.hidden_size
    indexer = 4 * context + 2 * m.index_n_heads * m.index_head_dim
    attention = 2 * m.num_attention_heads * (m.latent_dim + m.kv_lora_rank) * 2
    moe = m.num_experts_per_tok * (3 * m.hidden_size + 2 * 2 * m.moe_intermediate_size)
    return base + max(indexer, attention, moe, 4 * m.vocab_size)


def planned_hot_rows(cfg: Config) -> int:
    """Hot rows per request per layer the plan assumes: an explicit
    cache.hot_buffer_rows as given, else the union of the s_q queries' top-k sets."""
    if cfg.cache.hot_buffer_rows:
        return cfg.cache.hot_buffer_rows
    return mtp.union_rows(cfg.model.index_topk, 1 + cfg.engine.num_draft_tokens)


def per_request_bytes(cfg: Config, context: int, offload: bool,
                      hot_rows: int | None = None) -> dict[str, int]:
    """Device bytes one request holds (cache parts) and host bytes it needs (no headroom).

    As the engine allocates a batch slot (`jlco.engine.allocation.allocate_cache`): the hot buffer
    has hot_buffer_rows rows (or `hot_rows`) whatever the context; `tables` are its int32
    length, its penalty tables (`util.sampling_tables`) and, offloaded, its page-table row
    and the hot buffer's slot position + stamp (int32) and prefetched flag (bool) per
    row of each slot table. Indexer keys
    are cached by the layers that run an indexer only (a layer that shares its top-k,
    IndexShare, holds none), plus the MTP layer's; those layers are also the slot
    tables (a shared layer uses its full layer's, `offload.latent.share_groups`)."""
    layers = cache_layers(cfg)
    key_layers = cfg.model.indexer_layers + cfg.model.num_nextn_predict_layers
    s_q = 1 + cfg.engine.num_draft_tokens
    rows = cfg.hot_buffer_rows if hot_rows is None else hot_rows
    latent_rows = rows if offload else context
    pages = -(-context // cfg.cache.page_size)
    tables = 4 + penalty_table_bytes(cfg.model.vocab_size) + (
        4 * pages + 9 * latent_rows * key_layers if offload else 0)
    return dict(indexer=context * key_layers * cfg.indexer_key_bytes,
                latent_device=latent_rows * layers * cfg.row_bytes, tables=tables,
                activations=s_q * activation_bytes_per_token(cfg, context),
                host=context * layers * cfg.row_bytes if offload else 0)


def max_batch(cfg: Config, device_bytes: float, *, offload: bool | None = None,
              ep: int = 1, context: int | None = None, reserve_bytes: float = 0.0,
              weight_format: str = "fp8", tensor: int = 1, hot_rows: int | None = None) -> int:
    """Largest batch whose caches and activations fit in `device_bytes` beside the
    weights and reserve (memory limit only; not capped by engine.max_batch_size).
    `hot_rows` defaults to cfg.hot_buffer_rows (what the engine allocates)."""
    offload = cfg.cache.offload if offload is None else offload
    context = cfg.engine.max_context_len if context is None else context
    free = (device_bytes - reserve_bytes
            - weight_bytes(cfg.model, ep, weight_format, tensor).total)
    pr = per_request_bytes(cfg, context, offload, hot_rows)
    per = pr["indexer"] + pr["latent_device"] + pr["tables"] + pr["activations"]
    return max(0, int(free // per))


@dataclasses.dataclass(frozen=True)
class TransferCheck:
    """Can one step's missed rows cross the host link while the step computes?"""
    miss_rows_per_step: float
    source: str
    transfer_s: float
    compute_s: float
    hides: bool
    warning: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device memory (weights, per-request caches, largest batches) and per-host pool.
    `host_bytes_needed` is one device's (one attention rank's) admitted requests;
    `host_bytes_per_host` all attention ranks on a host at that batch."""
    config: str
    hardware: str
    ep: int
    context: int
    s_q: int
    device_bytes: float
    weights: WeightBytes
    reserve_bytes: float
    free_for_requests: float
    per_request_offload: dict
    per_request_no_offload: dict
    max_batch_offload: int
    max_batch_no_offload: int
    config_cap: int
    batch_offload: int
    batch_no_offload: int
    host_bytes_needed: float
    transfer: TransferCheck | None
    mesh: dict = dataclasses.field(default_factory=dict)
    hosts: dict = dataclasses.field(default_factory=dict)
    hot_rows: int = 0
    hot_rows_engine_min: int = 0
    max_batch_offload_engine_min: int = 0
    host_bytes_per_host: float = 0.0
    host_bytes_per_host_at_max: float = 0.0

    def as_dict(self) -> dict:
        """Plain JSON-ready values (numpy scalars become Python numbers and bools)."""
        d = dataclasses.asdict(self)
        d["weights"]["total"] = self.weights.total
        return _plain(d)


def _plain(v):
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v.item() if isinstance(v, np.generic) else v


def plan(cfg: Config, hw: HardwareProfile, *, ep: int = 1, context: int | None = None,
         miss_rate: float | None = None, accept: float | None = None,
         weight_format: str = "fp8", reserve_bytes: float | None = None,
         check_transfer: bool = True, mesh: MeshShape | None = None,
         devices_per_host: int = 8) -> MemoryPlan:
    """The memory plan for `cfg` on one `hw` device of `mesh` (default: data=1,
    expert=ep, tensor=1; giving both a mesh and a different ep is refused)."""
    context = cfg.engine.max_context_len if context is None else context
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"context={context!r} is invalid: allowed a positive integer")
    reserve = hw.runtime_reserve_gb.value * 1e9 if reserve_bytes is None else reserve_bytes
    if not reserve >= 0:   # a negative reserve would silently inflate the batch
        raise ValueError(f"reserve_bytes={reserve!r} is invalid: allowed >= 0")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep={ep!r} is invalid: allowed a positive integer")
    if mesh is None:
        mesh = MeshShape(1, ep, 1)
    elif ep not in (1, mesh.expert):
        raise ValueError(f"ep={ep} conflicts with mesh expert={mesh.expert}: give one")
    ep, tp = mesh.expert, mesh.tensor
    layout = host_layout(mesh, devices_per_host)
    w = weight_bytes(cfg.model, ep, weight_format, tp)
    hot = planned_hot_rows(cfg)
    kw = dict(ep=ep, context=context, reserve_bytes=reserve, weight_format=weight_format,
              tensor=tp)
    b_off = max_batch(cfg, hw.hbm_bytes, offload=True, hot_rows=hot, **kw)
    b_eng = max_batch(cfg, hw.hbm_bytes, offload=True, **kw)
    b_dev = max_batch(cfg, hw.hbm_bytes, offload=False, **kw)
    cap = cfg.engine.max_batch_size
    pr_off = per_request_bytes(cfg, context, True, hot)
    batch = min(b_off, cap)
    per_req_host = pr_off["host"] * (1.0 + cfg.cache.host_headroom)
    xfer = (transfer_check(cfg, hw, batch, ep, context, miss_rate, accept, hot)
            if check_transfer and batch > 0 else None)
    ranks = layout.attention_ranks_per_host
    return MemoryPlan(cfg.name, hw.name, ep, context, 1 + cfg.engine.num_draft_tokens,
                      hw.hbm_bytes, w, reserve, hw.hbm_bytes - reserve - w.total, pr_off,
                      per_request_bytes(cfg, context, False), b_off, b_dev, cap, batch,
                      min(b_dev, cap), batch * per_req_host, xfer, mesh.as_dict(),
                      layout.as_dict(), hot, cfg.hot_buffer_rows, b_eng,
                      ranks * batch * per_req_host, ranks * b_off * per_req_host)


def transfer_check(cfg: Config, hw: HardwareProfile, batch: int, ep: int, context: int,
                   miss_rate: float | None = None, accept: float | None = None,
                   hot_rows: int | None = None) -> TransferCheck:
    """Missed rows per step (from `miss_rate` × lookups, else LRU replay of ESS-shaped
    synthetic traces scaled by the simulator's fitted miss_scale) × row bytes ÷ host
    link, against the simulator's roofline step time without misses. Lookups per
    request per layer are the union of the s_q queries' top-k sets."""
    drafts = cfg.engine.num_draft_tokens
    s_q = 1 + drafts
    accept = 1.0 + 0.35 * drafts if accept is None else accept
    layers = cfg.model.num_hidden_layers
    setup = sim.Setup(hw=hw, model=cfg.model, context=context, num_draft=drafts,
                      accept=accept, ep=ep, row_bytes=cfg.row_bytes,
                      key_bytes=cfg.indexer_key_bytes)
    consts = sim.fitted()
    if miss_rate is not None:
        if not 0.0 <= miss_rate <= 1.0:
            raise ValueError(f"miss_rate={miss_rate} is invalid: allowed 0..1")
        lookups = mtp.union_rows(cfg.model.index_topk, s_q)
        rows = miss_rate * batch * layers * lookups
        source = f"--miss_rate {miss_rate} x {lookups} lookups (top-k union over s_q {s_q})"
    else:
        hot = cfg.hot_buffer_rows if hot_rows is None else hot_rows
        per_req = sim.misses_at(setup, hot).sum()
        rows = consts[sim.FIT_NAMES.index("miss_scale")] * per_req * batch
        source = "ESS locality profile (synthetic LRU replay x fitted miss_scale)"
    compute = float(sim.step_time(setup, batch, np.zeros(layers), np.array(consts)))
    # Python floats and bool, not numpy scalars: MemoryPlan.as_dict() goes to json.dumps
    # (`jlco.plan --json`), which rejects numpy's bool.
    transfer = float(rows * cfg.row_bytes / hw.host_bw)
    hides = bool(transfer <= compute)
    warn = "" if hides else (f"WARNING: {transfer * 1e3:.1f} ms of miss transfer per step "
                             f"cannot hide behind {compute * 1e3:.1f} ms of compute")
    return TransferCheck(float(rows), source, transfer, compute, hides, warn)


def _gb(x: float) -> str:
    return f"{x / 1e9:9.2f} GB"


def format_table(p: MemoryPlan) -> str:
    w, m, h = p.weights, p.mesh, p.hosts
    po = p.per_request_offload
    rows = [f"plan: config {p.config} on {p.hardware}, mesh data={m['data']} expert="
            f"{m['expert']} tensor={m['tensor']} ({m['devices']} devices, {h['hosts']} "
            f"host(s) x {h['devices_per_host']}), context {p.context}, s_q {p.s_q}",
            "all device figures are per device; a device's batch = its attention rank's "
            "requests",
            f"device memory          {_gb(p.device_bytes)}",
            f"weights per device     {_gb(w.total)}  ({w.params_rank / 1e9:.2f} B of "
            f"{w.params_total / 1e9:.2f} B params; routed experts {_gb(w.routed_experts)})",
            f"runtime reserve        {_gb(p.reserve_bytes)}",
            f"free for requests      {_gb(p.free_for_requests)}"]
    for name, pr in (("offload", po), ("no offload", p.per_request_no_offload)):
        rows.append(f"per request, {name:<10} indexer cache {_gb(pr['indexer'])}  latent on "
                    f"device {_gb(pr['latent_device'])}  activations {_gb(pr['activations'])}")
    rows += [f"hot buffer             {p.hot_rows} rows/layer/request (engine minimum "
             f"top-k x s_q: {p.hot_rows_engine_min}; largest batch at that size "
             f"{p.max_batch_offload_engine_min})",
             f"largest batch, offload    {p.max_batch_offload:6d} (memory)  -> admitted "
             f"{p.batch_offload} (engine.max_batch_size {p.config_cap})",
             f"largest batch, no offload {p.max_batch_no_offload:6d} (memory)  -> admitted "
             f"{p.batch_no_offload}",
             f"at the largest offload batch per device: indexer cache "
             f"{_gb(p.max_batch_offload * po['indexer'])}  hot buffer "
             f"{_gb(p.max_batch_offload * po['latent_device'])}",
             f"host pool per device   {_gb(p.host_bytes_needed)} (batch {p.batch_offload}, "
             f"with headroom)",
             f"host pool per host     {_gb(p.host_bytes_per_host)} ({h['attention_ranks_per_host']}"
             f" attention rank(s) x batch {p.batch_offload}); at the largest batch "
             f"{_gb(p.host_bytes_per_host_at_max)}"]
    t = p.transfer
    if t is not None:
        rows.append(f"transfer: {t.miss_rows_per_step:.0f} miss rows/step ({t.source}) -> "
                    f"{t.transfer_s * 1e3:.2f} ms vs compute {t.compute_s * 1e3:.2f} ms")
        if t.warning:
            rows.append(t.warning)
    return "\n".join(rows)
