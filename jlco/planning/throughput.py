"""Decode-throughput simulator for a DeepSeek-V3.2 decode node, with and without offload.

Per GPU and per decode step (B requests, s_q = 1 + drafts query tokens each, T = B·s_q),
every op is a roofline `max(FLOPs / (peak·eff), bytes / (HBM·eff_mem))` on the hardware
profile. A layer has two sides. The attention side: attention GEMMs, the indexer, sparse
MLA and whatever part of the H2D fetch of missed latent rows does not hide behind the
resident attention and the other micro-batch's indexer (ESS DA/DBA, docs/facts.md §3).
The MoE side: dispatch, expert GEMMs, combine, serial within a micro-batch (each needs
the previous one's output). Two-batch overlap (TBO) runs one micro-batch's attention
side while the other's MoE side runs: layer = max(attention side, MoE side) + a fixed
per-layer overhead. The all-to-all is DeepEP's low-latency kernels: pure RDMA, every
copy crosses the NIC. Misses per layer come from replaying ESS-shaped synthetic top-k
traces (LRU, `jlco.planning.trace`) at the hot-buffer size memory allows, scaled to
ESS's published miss counts (`ess_miss_scale`). Throughput per node =
gpus_per_node · B · accepted / step time.

Four constants are fitted on ESS's five 32K / MTP 2 calibration rows (`FIT_NAMES` less
`miss_scale`, which is pinned); everything else is setup (hardware profile, ESS's PCIe
and FlashMLA figures, DeepEP's transport). ESS's other published rows (`ESS_HELD_OUT`:
MTP 4 at 32K, MTP 2 at 128K) are never fitted; `run` reports them. `python -m jlco.sim`.

The indexer op's bytes and FLOPs are the roofline's (`roofline.indexer_scores`: keys read,
f32 logits written and read by top-k, 2·H·D per query-position); its FLOPs run at the
published rate of a DSA decode kernel (FlashMLA sparse decode, `INDEXER_EFF`), its bytes
at the fitted HBM efficiency. `indexer_band` turns the calibration residuals into a ±
band on it: an indexer cost off by δ moves a 32K step by δ × (indexer share of the step),
so the rows only rule out δ > max residual / share, and a prediction carries
± (δ × its indexer time + max residual × the rest).

With MTP the hot buffer's smallest size is the union of the s_q queries' top-k sets
(`jlco.planning.mtp.union_rows`), not top-k × s_q.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jlco.config import ModelConfig
from jlco.planning import mtp, sensitivity, trace
from jlco.planning.hardware import HardwareProfile, get_hardware
from jlco.planning.mesh import MeshShape
from jlco.planning.params import param_counts, weight_bytes
from jlco.planning.roofline import indexer_scores

FIT_NAMES = ("gemm_eff", "mem_eff", "net_eff", "miss_scale", "layer_overhead_us")
# FlashMLA sparse decode reaches ~410 TFLOP/s on H800 (bf16 peak 989): docs/facts.md §2.
MLA_EFF = 410.0 / 989.0
# The indexer's score kernel (DeepGEMM's paged MQA logits: per query 64 heads x 128 dims
# against every cached key, ReLU, a head-weighted sum) has no published rate; FlashMLA's
# sparse decode is the only published rate of a DSA decode kernel on Hopper, so the
# indexer's FLOPs run at that rate (a fraction of the bf16 peak), not at the fitted GEMM
# efficiency: the calibration rows cannot see the indexer (it hides behind the MoE side
# at 32K), and the fitted fp8 rate (0.38 x 1979 before issue 45) was 1.85x any published
# DSA kernel. docs/facts.md §3 "Simulator" has the evidence.
INDEXER_EFF = MLA_EFF
# ESS calibration rows (docs/facts.md §3): 32K, MTP 2, accept 1.7, EP 32; (batch, ratio, tok/s).
ESS_ROWS = ((52, 1.00, 9647.71), (64, 0.82, 10693.31), (96, 0.48, 13155.98),
            (128, 0.31, 15620.14), (160, 0.21, 16347.88))
# ESS's other published rows, never fitted: Table 2 of arXiv 2512.10576 (docs/facts.md §3),
# (name, context, drafts, accept, ((batch per GPU, sparse memory ratio, node tokens/s), ...)).
# The 128K batch-13 row's OTPS column reads 23.19 (the 32K row's value); its tokens/s,
# 3669.19 = 8 x 13 x 35.28, is the one the paper's +123 % uses, and is the target here.
ESS_HELD_OUT = (
    ("32k_mtp4_accept2.8", 32768, 4, 2.8, ((52, 1.00, 12168.02), (64, 0.82, 13656.66),
                                           (96, 0.48, 15814.07), (128, 0.31, 17746.10),
                                           (160, 0.21, 17601.03))),
    ("32k_mtp4_accept3.4", 32768, 4, 3.4, ((52, 1.00, 14775.45), (64, 0.82, 16583.08),
                                           (96, 0.48, 19202.80), (128, 0.31, 21548.83),
                                           (160, 0.21, 21372.68))),
    ("128k_mtp2_accept1.7", 131072, 2, 1.7, ((13, 1.00, 3669.19), (40, 0.20, 6925.06),
                                             (54, 0.10, 8169.60))),
)
# Mean missed rows per request per layer per step in ESS Fig. 5 (32K, MTP 2, sparse memory
# ratio 0.2; the curve runs 16.7-605 over the layers, docs/facts.md §3), read off the figure
# layer by layer: 178 (+-10 %). Pins `miss_scale` (`ess_miss_scale`).
ESS_FIG5_MEAN_MISSES = 178.0
# Largest KV bytes the ESS table keeps per GPU: 160 × 32768 × 61 × (656·0.21 + 132).
ESS_KV_BUDGET = 160 * 32768 * 61 * (656 * 0.21 + 132)


@dataclasses.dataclass(frozen=True)
class Setup:
    """One decode deployment. Defaults = ESS: 4 nodes × 8 GPUs, EP 32, TP 1, PCIe 5 with
    FlashTrans gather (37 GB/s H2D, 43 GB/s D2H), 400 Gb/s RDMA NIC per GPU (50 GB/s;
    setup assumption, ESS does not state it), H200 (the KV budget implies ~141 GB)."""
    hw: HardwareProfile = get_hardware("h200")
    model: ModelConfig = ModelConfig()
    context: int = 32768
    num_draft: int = 2
    accept: float = 1.7
    ep: int = 32
    gpus_per_node: int = 8
    tbo: bool = True
    h2d_gbps: float = 37.0
    d2h_gbps: float = 43.0
    net_gbps: float = 50.0
    row_bytes: int = 656
    key_bytes: int = 132
    kv_budget: float = ESS_KV_BUDGET
    # Assumptions of the step model that no calibration row pins (all rows are at 32K);
    # `jlco.planning.sensitivity` varies each. topk_passes: full reads of the indexer's
    # f32 logits by top-k (ESS: DeepGEMM's logits kernel writes them, a separate top-k
    # kernel reads them; a streaming block top-k reads once, a radix select twice: a
    # histogram pass, then a collect pass; its later passes see only the boundary bin).
    # indexer_overlap: the fraction of a layer's indexer time the H2D fetch can hide
    # behind; the fetch needs the top-k that indexer computes, so with two micro-batches
    # (DBA) only the second one's indexer runs while the first one's misses travel: 1/2.
    # attention_overlap: the fraction of sparse-attention time it hides behind (DA:
    # attention over resident rows runs while misses are in flight: all of it).
    # indexer_mem_scale: the indexer's fraction of HBM bandwidth relative to the fitted
    # mem_eff (1 = the same). The fit sees the indexer as 14-17 % of a 32K step, so
    # mem_eff is mostly the weights' streaming; a long contiguous key scan may reach
    # more of the bandwidth, and at 128K the keys are most of the step's bytes.
    # a2a_all_rdma: the decode all-to-all is DeepEP's low-latency kernels, "pure RDMA"
    # (DeepEP README): every expert copy, same-node ones too, goes through the NIC. False:
    # the copies to the node's own GPUs ride NVLink (DeepEP's normal kernels; prefill).
    topk_passes: float = 1.0
    indexer_overlap: float = 0.5
    attention_overlap: float = 1.0
    indexer_mem_scale: float = 1.0
    a2a_all_rdma: bool = True

    @property
    def s_q(self) -> int:
        return 1 + self.num_draft


def _ops(m: ModelConfig, s: Setup, batch: int) -> dict[str, np.ndarray]:
    """FLOPs / bytes per layer (arrays over the 61 layers) and per step (heads, MTP)."""
    L, T, n_mb = s.context, batch * s.s_q, 2 if s.tbo else 1
    p = param_counts(m)
    moe = np.array([m.is_moe_layer(i) for i in range(m.num_hidden_layers)])
    experts = -(-m.n_routed_experts // s.ep)
    ffn_w = np.where(moe, (experts + m.n_shared_experts) * p["expert"], p["dense_ffn"])
    ffn_tok = np.where(moe, (m.num_experts_per_tok + m.n_shared_experts) * p["expert"],
                       p["dense_ffn"])
    attn = p["attention"] + p["indexer"]
    # The terms that grow with context L, per full layer (every layer runs an indexer
    # here), from `roofline.indexer_scores`: keys = B·L·key_bytes (each request's cached
    # keys read once, shared by its s_q queries); flops = 2·H·D per (query, position),
    # B·s_q·L of them; logits = the f32 score per (query, position), written once and
    # read `topk_passes` times by the top-k selection over the whole context (a
    # bandwidth-bound select: its compares are a few per element, far below the
    # indexer's 2·H·D). The fourth context term, the H2D fetch, is in `step_terms`.
    idx = indexer_scores(m, s.key_bytes, (L,) * batch, s.s_q)
    logits = 0.5 * idx["logits"] * (1.0 + s.topk_passes)
    hidden_bytes = m.num_experts_per_tok * m.hidden_size * 3  # fp8 dispatch + bf16 combine
    # Share of the all-to-all bytes that cross the NIC (an EP group inside one node: none).
    if s.ep <= s.gpus_per_node:
        inter_node = 0.0
    else:
        inter_node = 1.0 if s.a2a_all_rdma else 1.0 - s.gpus_per_node / s.ep
    ones = np.ones(len(moe))
    return dict(
        gemm_f=2.0 * T * (attn + ffn_tok), gemm_b=n_mb * (attn + ffn_w) * ones,
        attn_f=2.0 * T * attn * ones, attn_b=n_mb * attn * ones,
        ffn_f=2.0 * T * ffn_tok, ffn_b=n_mb * ffn_w * ones,
        idx_f=float(idx["flops"]) * np.ones(len(moe)),
        idx_b=float(idx["keys"] + logits) * np.ones(len(moe)),
        mla_f=2.0 * T * m.index_topk * m.num_attention_heads * (m.latent_dim + m.kv_lora_rank)
        * np.ones(len(moe)),
        comm_b=np.where(moe, T * hidden_bytes * inter_node, 0.0),
        head_f=2.0 * T * m.vocab_size * m.hidden_size, head_b=2.0 * m.vocab_size * m.hidden_size,
        mtp_f=2.0 * batch * (attn + (m.num_experts_per_tok + m.n_shared_experts) * p["expert"]
                             + 2 * m.hidden_size ** 2 + m.vocab_size * m.hidden_size),
        mtp_b=attn + (experts + m.n_shared_experts) * p["expert"] + 2 * m.hidden_size ** 2
        + 2.0 * m.vocab_size * m.hidden_size,
    )


def step_time(s: Setup, batch: int, misses: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Step seconds. `misses`: missed rows per request per layer per step ([layers]).
    `c`: constants, shape [..., 5] in FIT_NAMES order (broadcast, for grid fitting)."""
    return step_parts(s, batch, misses, c)[0]


def step_parts(s: Setup, batch: int, misses: np.ndarray,
               c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step seconds, of which the indexer op's roofline time: main layers + MTP share)."""
    p = step_terms(s, batch, misses, c)
    return p["step"], p["indexer_total"]


def step_terms(s: Setup, batch: int, misses: np.ndarray, c: np.ndarray) -> dict:
    """Every term of the step (seconds; per layer [..., layers] where it has layers)."""
    c = np.asarray(c, float)
    ge, me, ne, ms, oh = (c[..., i][..., None] for i in range(5))
    o, hw = _ops(s.model, s, batch), s.hw
    fp8, bf16, bw = hw.flops("fp8"), hw.flops("bf16"), hw.hbm_bw
    attn = np.maximum(o["attn_f"] / (fp8 * ge), o["attn_b"] / (bw * me))
    ffn = np.maximum(o["ffn_f"] / (fp8 * ge), o["ffn_b"] / (bw * me))
    idx = np.maximum(o["idx_f"] / (bf16 * INDEXER_EFF),
                     o["idx_b"] / (bw * me * s.indexer_mem_scale))
    mla = o["mla_f"] / (bf16 * MLA_EFF)
    comm = o["comm_b"] / (s.net_gbps * 1e9 * ne)
    # Fetch volume: missed rows (per request per layer, from the LRU replay at the hot
    # rows the budget leaves: `misses_at`, which grows with context as the keys take
    # more of the budget and the top-k spreads over more positions) × row bytes over
    # the host link. It waits for its own layer's top-k, so it hides only behind the
    # sparse attention over resident rows and the other micro-batch's indexer
    # (`Setup.attention_overlap`, `Setup.indexer_overlap`); the rest delays its
    # micro-batch's attention side.
    xfer = ms * batch * misses * s.row_bytes / (s.h2d_gbps * 1e9)
    exposed = np.maximum(0.0, xfer - (s.attention_overlap * mla + s.indexer_overlap * idx))
    attn_side = attn + idx + mla + exposed
    moe_side = ffn + comm
    layer = np.maximum(attn_side, moe_side) if s.tbo else attn_side + moe_side
    per_layer = layer + oh * 1e-6
    head = np.maximum(o["head_f"] / (bf16 * ge), o["head_b"] / (bw * me))[..., 0]
    mtp_layer = np.maximum(o["mtp_f"] / (fp8 * ge), o["mtp_b"] / (bw * me))[..., 0]
    mtp = s.num_draft * (mtp_layer + (idx[..., 0] + mla[..., 0]) / s.s_q + oh[..., 0] * 1e-6)
    idx_total = idx.sum(-1) + s.num_draft * idx[..., 0] / s.s_q
    return dict(step=per_layer.sum(-1) + head + mtp, indexer_total=idx_total,
                attention_gemm=attn, indexer=idx, sparse_mla=mla, fetch=xfer,
                fetch_exposed=exposed, attention_side=attn_side, expert_gemm=ffn,
                all_to_all=comm, moe_side=moe_side, layer=layer, head=head, mtp=mtp,
                overhead=oh * 1e-6 * np.ones_like(layer))


@functools.lru_cache(maxsize=16)
def miss_curve(context: int, topk: int, num_layers: int, s_q: int, accept: float,
               steps: int = 32, warm: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """(capacities, misses[layers, capacities]): mean missed rows per request per step
    under LRU for ESS-shaped synthetic traces. Layers with the same overlap (rounded to
    0.1) share one replay; the first `warm` steps stand in for ESS's prefill warm-up.
    Capacities start at the MTP union (`mtp.union_rows`); below a layer's own step union
    the stack-distance count charges the overflow as misses."""
    prof = np.round(trace.ess_overlap_profile(num_layers), 1)
    caps = np.unique(np.concatenate([[min(mtp.union_rows(topk, s_q), context)], np.geomspace(
        topk * s_q, context, 28)]).astype(np.int64))
    out = np.zeros((num_layers, caps.size))
    for ov in np.unique(prof):
        sets = trace.synthetic_layer(context, topk, steps + warm, float(ov), s_q, accept,
                                     seed=int(ov * 100))
        ranks, n = trace.lru_stack_ranks(sets, warmup=warm)
        out[prof == ov] = [(ranks >= cap).sum() / n for cap in caps]
    return caps, out


def misses_at(s: Setup, hot_rows: float) -> np.ndarray:
    """Missed rows per request per step for each layer at `hot_rows` hot-buffer rows."""
    if hot_rows >= s.context:
        return np.zeros(s.model.num_hidden_layers)
    caps, mc = miss_curve(s.context, s.model.index_topk, s.model.num_hidden_layers, s.s_q,
                          s.accept)
    return np.array([np.interp(hot_rows, caps, row) for row in mc])


def hot_rows_for(s: Setup, batch: int) -> float:
    """Hot rows per request per layer when `batch` requests fill the KV budget."""
    layers = s.model.num_hidden_layers
    per_req = s.kv_budget / (batch * layers)
    return min(float(s.context), (per_req - s.context * s.key_bytes) / s.row_bytes)


def ess_setups() -> list[tuple[Setup, int, float, float]]:
    """The calibration rows as (setup, batch, ratio r, target step seconds)."""
    s = Setup()
    return [(s, b, r, s.gpus_per_node * b * s.accept / tps) for b, r, tps in ESS_ROWS]


@functools.lru_cache(maxsize=1)
def ess_miss_scale() -> float:
    """ESS's mean missed rows per request per layer (Fig. 5: 32K, MTP 2, ratio 0.2) over
    the synthetic LRU replay's at the same point: real misses / synthetic-trace misses."""
    s = Setup()
    return float(ESS_FIG5_MEAN_MISSES / misses_at(s, 0.2 * s.context).mean())


def fit(grid: int = 13, rounds: int = 3) -> dict[str, float]:
    """Fit FIT_NAMES on the ESS calibration rows: grid search over the three
    efficiencies, the per-layer overhead by weighted least squares (it enters linearly),
    then finer grids around the best point. Minimises the squared relative step-time
    error. Efficiencies stay in (0, 1]. `miss_scale` is not fitted: the calibration rows
    cannot see the fetch (at 32K it hides behind the MoE side), so it is pinned to ESS's
    published miss counts (`ess_miss_scale`)."""
    rows = ess_setups()
    miss = [misses_at(s, r * s.context) for s, _, r, _ in rows]
    y = np.array([t for *_, t in rows])
    w = 1.0 / y ** 2
    n_oh = 1e-6 * (rows[0][0].model.num_hidden_layers + rows[0][0].num_draft)
    ms = ess_miss_scale()
    bound_lo, bound_hi = np.array([0.1, 0.2, 0.1]), np.array([1.0, 1.0, 1.0])
    lo, hi, best = bound_lo.copy(), bound_hi.copy(), None
    for _ in range(rounds):
        axes = [np.linspace(a, b, grid) for a, b in zip(lo, hi)]
        g = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
        c = np.concatenate([g, np.full((len(g), 1), ms), np.zeros((len(g), 1))], 1)
        base = np.stack([step_time(s, b, mi, c) for (s, b, _, _), mi in zip(rows, miss)], 1)
        oh = np.clip(((y - base) * w).sum(1) / (n_oh * w.sum()), 0.0, None)
        err = (((base + oh[:, None] * n_oh - y) / y) ** 2).sum(1)
        i = int(np.argmin(err))
        best = np.concatenate([g[i], [ms, oh[i]]])
        span = 2 * (hi - lo) / (grid - 1)
        lo, hi = np.maximum(g[i] - span, bound_lo), np.minimum(g[i] + span, bound_hi)
    return dict(zip(FIT_NAMES, map(float, best)))


@functools.lru_cache(maxsize=1)
def fitted() -> tuple[float, ...]:
    """The fitted constants (computed once per process)."""
    f = fit()
    return tuple(f[k] for k in FIT_NAMES)


def throughput(s: Setup, batch: int, offload: bool, consts=None) -> dict:
    """Node tokens/s, OTPS and step time at `batch` (offload: hot rows fill the budget)."""
    consts = fitted() if consts is None else consts
    hot = hot_rows_for(s, batch) if offload else float(s.context)
    misses = misses_at(s, hot) if offload else np.zeros(s.model.num_hidden_layers)
    t = float(step_time(s, batch, misses, np.array(consts)))
    return dict(batch=batch, hot_rows=hot, ratio=hot / s.context, step_ms=1e3 * t,
                otps=s.accept / t, node_tokens_s=s.gpus_per_node * batch * s.accept / t,
                miss_rows_per_req_step=float(misses.sum()))


def fetch_stall(s: Setup, batch: int, ratio: float, consts=None) -> dict:
    """The step's host→device fetch at `batch` requests with hot rows = `ratio` × context:
    rows and bytes per step, the hot buffer's hit rate, and the fetch stall (step time
    with the fetch − step time with no misses) with and without overlap. Overlapped: the
    fetch hides behind the resident attention and the other micro-batch's indexer (ESS DA
    + DBA, `Setup.attention_overlap` / `indexer_overlap`); without: it waits for its
    layer's top-k and the attention waits for it (on-demand fetch, SGLang's default)."""
    consts = fitted() if consts is None else consts
    c = np.array(consts)
    layers = s.model.num_hidden_layers
    misses = misses_at(s, ratio * s.context) if ratio < 1.0 else np.zeros(layers)
    ms = c[FIT_NAMES.index("miss_scale")]
    rows = float(ms * batch * misses.sum())
    lookups = min(mtp.union_rows(s.model.index_topk, s.s_q), s.context)
    serial = dataclasses.replace(s, attention_overlap=0.0, indexer_overlap=0.0)
    t0 = float(step_time(s, batch, np.zeros(layers), c))
    t_ov = float(step_time(s, batch, misses, c))
    t_no = float(step_time(serial, batch, misses, c))
    return dict(batch=batch, ratio=ratio, hot_rows=ratio * s.context,
                missed_rows_per_step=rows, fetch_bytes_per_step=rows * s.row_bytes,
                lookups_per_request_layer=lookups,
                hit_rate=1.0 - float(ms * misses.mean()) / lookups,
                h2d_gbps=s.h2d_gbps, transfer_ms=1e3 * rows * s.row_bytes / (s.h2d_gbps * 1e9),
                step_ms_no_misses=1e3 * t0, step_ms_overlap=1e3 * t_ov,
                step_ms_no_overlap=1e3 * t_no, stall_ms_overlap=1e3 * (t_ov - t0),
                stall_ms_no_overlap=1e3 * (t_no - t0))


def held_out(hw: HardwareProfile, consts=None) -> list[dict]:
    """ESS's published rows that the fit never sees (`ESS_HELD_OUT`): each at its batch
    and sparse memory ratio, target and predicted node tokens/s, the error, the step's
    terms (ms, summed over layers) and its fetch stall."""
    consts = fitted() if consts is None else consts
    out = []
    for name, ctx, drafts, acc, rows in ESS_HELD_OUT:
        s = Setup(hw=hw, context=ctx, num_draft=drafts, accept=acc)
        for b, r, target in rows:
            misses = misses_at(s, r * ctx) if r < 1.0 else np.zeros(s.model.num_hidden_layers)
            terms = step_terms(s, b, misses, np.array(consts))
            t = float(terms["step"])
            tps = s.gpus_per_node * b * acc / t
            out.append(dict(setting=name, batch=b, ratio=r, target_tokens_s=target,
                            sim_tokens_s=tps, error_pct=100.0 * (tps / target - 1.0),
                            target_step_ms=1e3 * s.gpus_per_node * b * acc / target,
                            sim_step_ms=1e3 * t, terms_ms={
                                k: 1e3 * float(np.sum(v)) for k, v in terms.items()
                                if k not in ("step", "indexer_total")},
                            fetch=fetch_stall(s, b, r, consts)))
    return out


def batch_limits(s: Setup) -> tuple[int, int]:
    """(no-offload, offload) memory limits at the same KV budget. With offload the hot
    buffer must hold the union of the s_q queries' top-k sets (`mtp.union_rows`)."""
    layers = s.model.num_hidden_layers
    full = s.context * layers * (s.row_bytes + s.key_bytes)
    min_hot = mtp.union_rows(s.model.index_topk, s.s_q)
    offl = s.context * layers * s.key_bytes + min_hot * layers * s.row_bytes
    return int(s.kv_budget // full), int(s.kv_budget // offl)


def predict(s: Setup, consts=None, max_points: int = 40, band: dict | None = None) -> dict:
    """Best throughput with and without offload at the same KV budget, and the curve.
    `band` (from `indexer_band`) adds each best point's ± band."""
    b_dev, b_off = batch_limits(s)
    no_off = [throughput(s, b, False, consts) for b in _batches(1, b_dev, max_points)]
    off = [throughput(s, b, True, consts) for b in _batches(1, b_off, max_points)]
    best_off = max(off, key=lambda d: d["node_tokens_s"])
    best_dev = no_off[-1]
    if band is not None:
        for best, offload in ((best_dev, False), (best_off, True)):
            best["band"] = point_band(s, best["batch"], offload, band, consts)
    return dict(context=s.context, num_draft=s.num_draft, accept=s.accept, ep=s.ep,
                kv_budget_bytes=s.kv_budget, batch_limit_no_offload=b_dev,
                batch_limit_offload=b_off, hot_rows_min=mtp.union_rows(
                    s.model.index_topk, s.s_q), no_offload=best_dev, offload=best_off,
                speedup=best_off["node_tokens_s"] / best_dev["node_tokens_s"],
                curve_no_offload=no_off, curve_offload=off)


def _indexer_split(s: Setup, batch: int, misses: np.ndarray, consts) -> tuple[float, float]:
    """(step seconds, the indexer op's seconds within it)."""
    t, ti = step_parts(s, batch, misses, np.array(consts))
    return float(t), float(ti)


def indexer_band(rows: list[tuple[Setup, int, float]], errors_pct: list[float],
                 consts) -> dict:
    """How sure the indexer cost is, from the calibration residuals: rows (setup, batch,
    ratio r) and their tokens/s errors. δ = max |residual| / smallest indexer share of a
    calibration step (an indexer cost off by more than δ would show in some row)."""
    shares = []
    for s, b, r in rows:
        t, ti = _indexer_split(s, b, misses_at(s, r * s.context), consts)
        shares.append(ti / t)
    resid = max(abs(e) for e in errors_pct) / 100.0
    share = min(shares)
    return dict(max_abs_residual=resid, calibration_indexer_share_min=share,
                calibration_indexer_share_max=max(shares),
                indexer_rel_uncertainty=resid / share if share > 0 else float("inf"),
                note="every calibration row is at 32K: the indexer op (roofline bytes "
                     "and FLOPs) is the only term that scales with context; +-band = "
                     "delta x indexer time + max residual x the rest of the step")


def point_band(s: Setup, batch: int, offload: bool, band: dict, consts=None) -> dict:
    """± band of one prediction (see `indexer_band`), plus the indexer op's roofline."""
    consts = fitted() if consts is None else consts
    hot = hot_rows_for(s, batch) if offload else float(s.context)
    misses = misses_at(s, hot) if offload else np.zeros(s.model.num_hidden_layers)
    t, ti = _indexer_split(s, batch, misses, consts)
    dt = band["indexer_rel_uncertainty"] * ti + band["max_abs_residual"] * (t - ti)
    tok = s.gpus_per_node * batch * s.accept
    idx = indexer_scores(s.model, s.key_bytes, (s.context,) * batch, s.s_q)
    return dict(indexer_ms=1e3 * ti, indexer_share=ti / t, step_ms_lo=1e3 * (t - dt),
                step_ms_hi=1e3 * (t + dt), node_tokens_s_lo=tok / (t + dt),
                node_tokens_s_hi=tok / max(t - dt, 1e-12), rel_band=dt / t,
                indexer_bytes_per_layer=idx["keys"] + idx["logits"],
                indexer_flops_per_layer=idx["flops"])


def _batches(lo: int, hi: int, n: int) -> list[int]:
    if hi < lo:
        return []
    return sorted(set(np.unique(np.linspace(lo, hi, n).astype(int)).tolist()) | {hi})


PREDICTIONS = (("32k_mtp4_accept2.8", 32768, 4, 2.8), ("32k_mtp4_accept3.4", 32768, 4, 3.4),
               ("128k_mtp2_accept1.7", 131072, 2, 1.7))


ESS_MESH = MeshShape(1, 32, 1)   # ESS: 32 GPUs, DP attention over all, EP 32, TP 1


def kv_budget_for(model: ModelConfig, mesh: MeshShape) -> float:
    """ESS's KV budget per GPU, less the extra weight bytes `mesh` puts on a device (more
    with a smaller expert degree) than ESS's EP 32."""
    extra = (weight_bytes(model, mesh.expert).total - weight_bytes(model, ESS_MESH.expert).total)
    budget = ESS_KV_BUDGET - extra
    if budget <= 0:
        raise ValueError(f"mesh {mesh.text()} is invalid for the simulator: its weights "
                         f"leave no KV budget ({extra / 1e9:.1f} GB more than EP 32)")
    return float(budget)


def run(hardware: str = "h200", mesh: MeshShape | None = None) -> dict:
    """Fit, check calibration, predict the held-out ESS setups on `mesh` (default ESS's):
    everything `--json` prints. The fit always uses ESS's own setup (its rows)."""
    hw = get_hardware(hardware)
    mesh = ESS_MESH if mesh is None else mesh
    if mesh.tensor != 1:
        raise ValueError(f"mesh tensor={mesh.tensor} is invalid for the simulator: allowed 1 "
                         "(its step model is TP 1, as ESS runs)")
    consts = fitted()
    calib, rows = [], []
    for s, b, r, y in ess_setups():
        s = dataclasses.replace(s, hw=hw)
        t = float(step_time(s, b, misses_at(s, r * s.context), np.array(consts)))
        tps = s.gpus_per_node * b * s.accept / t
        target = s.gpus_per_node * b * s.accept / y
        calib.append(dict(batch=b, ratio=r, target_tokens_s=target, sim_tokens_s=tps,
                          target_otps=s.accept / y, sim_otps=s.accept / t,
                          error_pct=100.0 * (tps / target - 1.0)))
        rows.append((s, b, r))
    band = indexer_band(rows, [c["error_pct"] for c in calib], consts)
    budget = kv_budget_for(Setup().model, mesh)
    preds, sens = {}, {}
    for name, ctx, drafts, acc in (("32k_mtp2_accept1.7", 32768, 2, 1.7),) + PREDICTIONS:
        setup = Setup(hw=hw, context=ctx, num_draft=drafts, accept=acc, ep=mesh.expert,
                      kv_budget=budget)
        preds[name] = predict(setup, consts, band=band)
        if name != "32k_mtp2_accept1.7":
            sens[name] = sensitivity.sensitivity(setup, consts, predict)
    held = held_out(hw, consts)
    caps, mc = miss_curve(32768, 2048, 61, 3, 1.7)
    return dict(
        hardware=hw.as_dict(),
        hardware_choice="ESS does not name its GPU; its KV budget (82-86 GB/GPU beside "
                        "~40 GB of EP32 weights) implies a ~141 GB part: H200 SXM.",
        setup=dict(ep=32, gpus_per_node=8, tbo=True, h2d_gbps=37.0, net_gbps=50.0,
                   kv_budget_bytes=ESS_KV_BUDGET, mla_eff_from_flashmla=MLA_EFF,
                   indexer_eff_of_bf16_peak=INDEXER_EFF, a2a_all_rdma=True,
                   miss_scale_from_ess_fig5=ess_miss_scale(),
                   ess_fig5_mean_misses=ESS_FIG5_MEAN_MISSES),
        mesh=dict(mesh.as_dict(), kv_budget_bytes=budget,
                  note="predictions per device of this mesh; calibration on ESS's EP 32"),
        mtp_union=dict(new_fraction=mtp.MTP_NEW_FRACTION,
                       hot_rows_min_by_s_q={q: mtp.union_rows(2048, q) for q in (1, 2, 3, 5)}),
        fitted_constants=dict(zip(FIT_NAMES, consts)), calibration=calib,
        max_abs_calibration_error_pct=max(abs(c["error_pct"]) for c in calib),
        indexer_uncertainty=band,
        predictions={k: v for k, v in preds.items() if k != "32k_mtp2_accept1.7"},
        published_held_out=held,
        max_abs_held_out_error_pct=max(abs(h["error_pct"]) for h in held),
        sensitivity=sens,
        calibration_setup_curves=preds["32k_mtp2_accept1.7"],
        miss_curve_32k_mtp2=dict(capacities=caps.tolist(),
                                 misses_per_req_step_all_layers=mc.sum(0).tolist()))
