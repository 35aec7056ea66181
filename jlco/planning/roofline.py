"""Roofline of one decode step, or of one prompt's whole prefill: the bytes it must touch
and the FLOPs it must do, and the shortest time a machine could run it in (max of
bytes / bandwidth and FLOPs / peak).

What one step over a batch of B requests with s_q query tokens each (1 + MTP drafts;
N = B·s_q tokens) must touch, for the main model (the MTP layer is not counted):

  weights, each read once per step, in the model dtype (4 B for float32, else 2 B; the
    router and the indexer's head-weight projection are float32 as jlco stores them):
    embedding rows of the N tokens, lm_head, every layer's MLA projections, indexer
    projections and norms; per MoE layer the router, the shared experts and the union of
    routed experts the tokens pick, bounded by min(E, N·k) experts; per dense layer the
    FFN;
  the cache, per layer: every indexer key of each request's context (fp8 keys: D bytes +
    a 4-byte scale per token; "bf16" keys: 2 B per element, 4 B in a float32 model), the
    top-k latent rows of every query token (`cfg.row_bytes` each; a query at cached
    position c + j sees c + j + 1 positions, so it reads min(topk, c + j + 1) rows; rows
    are counted per query token, as FlashMLA counts them), and the writes of the N new
    latent rows and indexer keys.
Activations and logits are not counted (small beside the above at decode shapes).

FLOPs: 2 · (matmul parameters one token uses: attention, indexer projections, router,
k routed + the shared experts or the dense FFN, lm_head) · N, plus per token per layer
the indexer scores 2·H·D·(positions it sees) and sparse MLA 2·h·(d_latent + kv_lora)·
min(topk, positions) (d_latent = kv_lora + rope = 576, kv_lora = 512 for DeepSeek-V3.2).

A whole prefill of one prompt (`prefill_cost`) is counted piece by piece as the engine
runs it (`jlco.engine.prefill.pieces`: whole chunks of `engine.prefill_chunk` tokens,
then the tail in pieces of the page grid, `jlco.util.buckets.piece_grid`, the last one
padded). A piece of q queries on lo cached positions costs what a decode step of s_q = q
on context lo costs (weights read once per piece, per-token matmuls, the indexer and
sparse MLA terms growing with position, the lo cached keys read once, the piece's own
rows and keys counted as cache writes), except that the LM head runs
on the piece's last token only. `useful` counts the real tokens and the positions each
really sees; `as_run` what the engine computes: every piece at its padded width, each
query scoring the whole indexer scan bucket (`jlco.model.kv_cache.scan_bucket` of the
piece's end, all of `max_context_len` once the bucket reaches it, its keys read once per
piece per layer) and gathering top-k latent rows. `as_run` is the padded work of the
sparse design, not a trace of the kernels: a kernel that skips key blocks past the
length scans fewer keys, and a chunk that attends densely (short contexts,
`jlco.model.attention.DENSE_MAX_T`) does other attention FLOPs. The indexer logits (an
activation) are left out, as for decode. Roofline time of a prefill: the sum of its
pieces' times.

May import: numpy, `jlco.config`, `jlco.planning.*`, `jlco.util` (as the rest of the wing).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jlco.config import Config, ModelConfig
from jlco.planning.hardware import get_hardware
from jlco.planning.params import layer_counts, param_counts
from jlco.util.buckets import (MIN_PIECE, MIN_SCAN, WARMUP_QUERIES, piece_grid,  # noqa: F401
                               pow2_bucket, prompt_pieces)

@dataclasses.dataclass(frozen=True)
class Machine:
    """The limits a roofline divides by: memory bandwidth (B/s), dense peak (FLOP/s) and,
    for accelerators, the host link (B/s per direction; None on a CPU)."""
    name: str
    mem_bw: float
    peak_flops: float
    host_bw: float | None = None
    source: str = ""

    def as_dict(self) -> dict:
        return dict(name=self.name, mem_gbps=self.mem_bw / 1e9,
                    peak_tflops=self.peak_flops / 1e12,
                    host_link_gbps=None if self.host_bw is None else self.host_bw / 1e9,
                    source=self.source)


def cpu_machine(mem_gbps: float | None = None, peak_gflops: float | None = None) -> Machine:
    """This CPU's limits: the figures given, the others measured on this machine
    (`jlco.planning.probe.cpu_limits`, cached per machine) — never another box's."""
    for name, v in (("mem_gbps", mem_gbps), ("peak_gflops", peak_gflops)):
        if v is not None and not v > 0:
            raise ValueError(f"{name}={v!r} is invalid: allowed a positive number (or none: "
                             "measured on this machine)")
    parts = []
    if mem_gbps is None or peak_gflops is None:
        from jlco.planning import probe
        lim = probe.cpu_limits()
        if mem_gbps is None:
            mem_gbps = lim["mem_gbps"]
            parts.append(f"{mem_gbps:.1f} GB/s read at {lim['working_set_mb']:.0f} MB")
        if peak_gflops is None:
            peak_gflops = lim["peak_gflops"]
            parts.append(f"{peak_gflops:.0f} GFLOP/s f32 matmul")
        parts = [f"measured on this machine ({', '.join(parts)}; jlco.planning.probe, "
                 f"{lim.get('measured', '')}, {lim['path']})"]
    given = [f"{v} {u} given" for v, u, n in ((mem_gbps, "GB/s", "m"), (peak_gflops,
                                                                          "GFLOP/s", "p"))]
    return Machine("cpu", mem_gbps * 1e9, peak_gflops * 1e9, None,
                   "; ".join(parts) if parts else ", ".join(given))


def hardware_machine(name: str) -> Machine:
    """A `jlco.planning.hardware` profile ('h200', ...) as a Machine: HBM bandwidth and
    the dense bf16 peak (a float32 model is still counted at the bf16 rate: the
    accelerators here have no faster f32 path, so this is a lower bound on time)."""
    hw = get_hardware(name)
    return Machine(hw.name, hw.hbm_bw, hw.flops("bf16"), hw.host_bw,
                   f"jlco.planning.hardware[{name!r}]: {hw.hbm_gbps.source}")


# device_kind substrings -> hardware profile keys (longest first: "H200" contains "H20").
_KINDS = (("H200", "h200"), ("H100", "h100"), ("H800", "h800"), ("H20", "h20"),
          ("B200", "b200"), ("TPU v5 lite", "tpu_v5e"), ("TPU v5e", "tpu_v5e"),
          ("TPU v5p", "tpu_v5p"), ("TPU v5", "tpu_v5p"), ("TPU v6 lite", "tpu_v6e"),
          ("TPU v6e", "tpu_v6e"))


def profile_for_device_kind(kind: str) -> str | None:
    """The hardware profile key for a jax `device_kind` string, or None if unknown."""
    for sub, key in _KINDS:
        if sub.lower() in kind.lower():
            return key
    return None


@dataclasses.dataclass(frozen=True)
class StepRoofline:
    """Bytes and FLOPs of one decode step, by part (see the module docstring)."""
    batch: int
    s_q: int
    contexts: tuple[int, ...]
    experts_touched: int          # routed experts read per MoE layer
    bytes: dict
    flops: dict

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def memory_s(self, m: Machine) -> float:
        return self.total_bytes / m.mem_bw

    def compute_s(self, m: Machine) -> float:
        return self.total_flops / m.peak_flops

    def time_s(self, m: Machine) -> float:
        """Roofline time: max(bytes / bandwidth, FLOPs / peak)."""
        return max(self.memory_s(m), self.compute_s(m))

    def as_dict(self, m: Machine | None = None) -> dict:
        d = dict(batch=self.batch, s_q=self.s_q, contexts=list(self.contexts),
                 experts_touched=self.experts_touched, bytes=dict(self.bytes),
                 flops=dict(self.flops), total_bytes=self.total_bytes,
                 total_flops=self.total_flops)
        if m is not None:
            d.update(memory_s=self.memory_s(m), compute_s=self.compute_s(m),
                     time_s=self.time_s(m),
                     bound="memory" if self.memory_s(m) >= self.compute_s(m) else "compute")
        return d


def index_key_bytes(cfg: Config) -> int:
    """Bytes per token per layer of the indexer keys: fp8 = D + 4 (scale); "bf16" keys
    in the model dtype's width (4 B per element for a float32 model, else 2 B)."""
    d = cfg.model.index_head_dim
    if cfg.cache.indexer_key_format == "fp8":
        return d + 4
    return (4 if cfg.model.dtype == "float32" else 2) * d


def indexer_scores(m: ModelConfig, key_bytes: int, contexts: Sequence[int],
                   s_q: int = 1) -> dict[str, int]:
    """One layer's lightning-indexer scoring for a decode step (the kernel that grows with
    context): `contexts[i]` cached positions of request i, `s_q` query tokens each (query j
    sees c + j + 1 positions). keys: every cached indexer key read once per request (fp8:
    D + 4 B); logits: the f32 score of every (query, position) written by the score
    kernel and read back by top-k (2 × 4 B; `decode_step_cost` leaves it out as an
    activation);
    flops: 2·H·D per (query, position) for q·k (the ReLU-weighted head sum is H more,
    negligible). The simulator's indexer op is exactly this."""
    seen = sum(c + j + 1 for c in contexts for j in range(s_q))
    return dict(keys=sum(contexts) * key_bytes, logits=2 * 4 * seen,
                flops=2 * m.index_n_heads * m.index_head_dim * seen)


def decode_step_cost(cfg: Config, batch: int, contexts: int | Sequence[int],
                     s_q: int = 1) -> StepRoofline:
    """Roofline bytes and FLOPs of one decode step: `batch` requests, each with
    `contexts[i]` positions already cached (an int applies to all), `s_q` query tokens
    per request (1 + draft tokens)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: allowed a positive integer")
    if isinstance(s_q, bool) or not isinstance(s_q, int) or s_q < 1:
        raise ValueError(f"s_q={s_q!r}: allowed a positive integer")
    ctx = (contexts,) * batch if isinstance(contexts, int) else tuple(int(c) for c in contexts)
    if len(ctx) != batch or any(c < 0 for c in ctx):
        raise ValueError(f"contexts={contexts!r}: allowed one integer >= 0, or {batch} of them")
    m = cfg.model
    w = 4 if m.dtype == "float32" else 2
    f32 = 4
    p = param_counts(m)
    n_tok = batch * s_q
    layers = m.num_hidden_layers
    n_dense, n_moe, n_idx = layer_counts(m)     # only n_idx layers run an indexer
    h, hh, d = m.hidden_size, m.index_n_heads, m.index_head_dim
    idx_lin = m.q_lora_rank * hh * d + h * d          # indexer wq_b + wk (model dtype)
    idx_wp = h * hh                                   # indexer weights_proj (float32)
    router = m.n_routed_experts * h                   # router matmul (+ bias, float32)
    touched = min(m.n_routed_experts, n_tok * m.num_experts_per_tok)
    # Positions query token j of request i sees: c_i + j + 1 (itself included).
    seen = [c + j + 1 for c in ctx for j in range(s_q)]
    rows = [min(m.index_topk, s) for s in seen]
    kb = index_key_bytes(cfg)
    idx = indexer_scores(m, kb, ctx, s_q)
    by = dict(
        embed=(0 if m.tie_word_embeddings else min(n_tok, m.vocab_size) * h * w),
        lm_head=m.vocab_size * h * w,
        attention=layers * p["attention"] * w,
        indexer=n_idx * (idx_lin * w + idx_wp * f32),
        norms=(layers * p["norms"] + p["final_norm"]) * w,
        router=n_moe * (router + m.n_routed_experts) * f32,
        routed_experts=n_moe * touched * p["expert"] * w,
        shared_experts=n_moe * m.n_shared_experts * p["expert"] * w,
        dense_ffn=n_dense * p["dense_ffn"] * w,
        index_keys=n_idx * idx["keys"],
        latent_rows=layers * sum(rows) * cfg.row_bytes,
        cache_writes=n_tok * (layers * cfg.row_bytes + n_idx * kb),
    )
    per_token = (layers * p["attention"] + n_idx * (idx_lin + idx_wp)
                 + n_moe * (router + (m.num_experts_per_tok + m.n_shared_experts) * p["expert"])
                 + n_dense * p["dense_ffn"] + m.vocab_size * h)
    fl = dict(
        matmul=2 * per_token * n_tok,
        indexer_scores=n_idx * idx["flops"],
        sparse_mla=layers * 2 * m.num_attention_heads * (m.latent_dim + m.kv_lora_rank)
        * sum(rows),
    )
    return StepRoofline(batch, s_q, ctx, touched, by, fl)


# ---- a whole prefill ---------------------------------------------------------------------

def prefill_pieces(n: int, chunk: int, grid: int) -> list[tuple[int, int, int]]:
    """The engine's pieces (lo, hi, computed width) of an n-token prompt
    (`jlco.util.buckets.prompt_pieces`: whole chunks, then tail pieces of `grid`)."""
    return prompt_pieces(n, chunk, grid)


def scan_positions(n: int, max_len: int) -> int:
    """Key positions the indexer scores for contexts of at most n positions
    (`jlco.model.kv_cache.scan_bucket`; its None = all max_len)."""
    b = pow2_bucket(n, MIN_SCAN)
    return max_len if b >= max_len else b


@dataclasses.dataclass(frozen=True)
class PrefillRoofline:
    """Bytes and FLOPs of one prompt's prefill, per piece (see the module docstring):
    `useful[i]` / `as_run[i]` cost `pieces[i]` = (lo, hi, width) with its real tokens /
    at its padded width; `scans[i]` the key positions its indexer scores."""
    prompt_len: int
    chunk: int
    pieces: tuple[tuple[int, int, int], ...]
    scans: tuple[int, ...]
    useful: tuple[StepRoofline, ...]
    as_run: tuple[StepRoofline, ...]

    def _parts(self, as_run: bool) -> tuple[StepRoofline, ...]:
        return self.as_run if as_run else self.useful

    def total_bytes(self, as_run: bool = False) -> int:
        return sum(p.total_bytes for p in self._parts(as_run))

    def total_flops(self, as_run: bool = False) -> int:
        return sum(p.total_flops for p in self._parts(as_run))

    def by_part(self, as_run: bool = False) -> tuple[dict, dict]:
        """(bytes, FLOPs) summed over the pieces, by part."""
        by, fl = collections.Counter(), collections.Counter()
        for p in self._parts(as_run):
            by.update(p.bytes)
            fl.update(p.flops)
        return dict(by), dict(fl)

    def time_s(self, m: Machine, as_run: bool = False) -> float:
        """Roofline time: the pieces run one after another, each at its own roofline."""
        return sum(p.time_s(m) for p in self._parts(as_run))

    def as_dict(self, m: Machine | None = None) -> dict:
        d = dict(prompt_len=self.prompt_len, chunk=self.chunk,
                 pieces=[list(p) for p in self.pieces], scans=list(self.scans))
        for name, run in (("useful", False), ("as_run", True)):
            by, fl = self.by_part(run)
            part = dict(bytes=by, flops=fl, total_bytes=self.total_bytes(run),
                        total_flops=self.total_flops(run))
            if m is not None:
                mem = sum(p.memory_s(m) for p in self._parts(run))
                comp = sum(p.compute_s(m) for p in self._parts(run))
                part.update(memory_s=mem, compute_s=comp, time_s=self.time_s(m, run),
                            bound="memory" if mem >= comp else "compute")
            d[name] = part
        return d


def _piece_cost(cfg: Config, lo: int, queries: int, scan: int | None) -> StepRoofline:
    """One prefill piece of `queries` query tokens at positions lo, lo + 1, ...: a decode
    step of s_q = queries on context lo with the LM head on one token. With `scan` (as
    run) every query scores all `scan` key positions (read once per layer) and gathers
    top-k rows whatever it sees."""
    m = cfg.model
    s = decode_step_cost(cfg, 1, lo, s_q=queries)
    by, fl = dict(s.bytes), dict(s.flops)
    fl["matmul"] -= 2 * m.vocab_size * m.hidden_size * (queries - 1)
    if scan is not None:
        layers, k, n_idx = m.num_hidden_layers, m.index_topk, m.indexer_layers
        by["index_keys"] = n_idx * scan * index_key_bytes(cfg)
        by["latent_rows"] = layers * queries * k * cfg.row_bytes
        fl["indexer_scores"] = n_idx * 2 * m.index_n_heads * m.index_head_dim * queries * scan
        fl["sparse_mla"] = (layers * 2 * m.num_attention_heads
                            * (m.latent_dim + m.kv_lora_rank) * queries * k)
    return StepRoofline(1, queries, (lo,), s.experts_touched, by, fl)


def prefill_cost(cfg: Config, prompt_len: int, chunk: int | None = None,
                 grid: int | None = None, max_len: int | None = None) -> PrefillRoofline:
    """Roofline bytes and FLOPs of prefilling one `prompt_len`-token prompt alone, as the
    engine runs it: whole chunks of `chunk` (default `engine.prefill_chunk`), then tail
    pieces of `grid` (default the engine's page grid), on a cache of `max_len` positions
    (default `engine.max_context_len`). Main model only (no MTP layer)."""
    chunk = cfg.engine.prefill_chunk if chunk is None else chunk
    max_len = cfg.engine.max_context_len if max_len is None else max_len
    if grid is None and isinstance(chunk, int) and chunk >= 1:
        grid = piece_grid(cfg.cache.page_size, chunk)
    for name, v, low in (("prompt_len", prompt_len, 1), ("chunk", chunk, 1),
                         ("grid", grid, 1), ("max_len", max_len, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r}: allowed an integer >= {low}")
    if prompt_len > max_len:
        raise ValueError(f"prompt_len={prompt_len}: allowed at most max_len={max_len}")
    if grid > chunk:
        raise ValueError(f"grid={grid}: allowed at most chunk={chunk}")
    pcs = tuple(prefill_pieces(prompt_len, chunk, grid))
    scans = tuple(scan_positions(min(lo + w, max_len), max_len) for lo, _, w in pcs)
    useful = tuple(_piece_cost(cfg, lo, hi - lo, None) for lo, hi, _ in pcs)
    as_run = tuple(_piece_cost(cfg, lo, w, sc) for (lo, _, w), sc in zip(pcs, scans))
    return PrefillRoofline(prompt_len, chunk, pcs, scans, useful, as_run)
