"""Hot-buffer rows an MTP step needs: the union of its s_q query tokens' top-k sets.

With MTP, a decode step scores s_q = 1 + drafts query tokens at consecutive positions and
reads the union of their top-k sets. Sizing the hot buffer as top-k × s_q (the engine's
minimum, `Config.min_hot_buffer_rows`) assumes the sets are disjoint; consecutive
queries share most of their selection (ESS: 0.7–0.9 overlap in most layers, docs/facts.md
§3), so the union is far smaller:

    union_rows(topk, s_q) = ceil(topk · (1 + (s_q − 1) · MTP_NEW_FRACTION))

MTP_NEW_FRACTION is the share of each further query's top-k that the earlier queries of
the step did not select, measured with `tools/cache_study.py --union_window` on
DeepSeek-V3.2-shaped traces (ESS's published per-layer overlap profile, 32K context,
top-k 2048, 61 layers, 24 steps after 4 warm-up steps), as the mean over layers of each
layer's largest union (a buffer sized per layer to hold its worst step):

    --queries_per_step 2 --accept 1.35: union / (2 × top-k) = 0.699 -> fraction 0.398
    --queries_per_step 3 --accept 1.7:  union / (3 × top-k) = 0.571 -> fraction 0.357

rounded up to 0.40 (the s_q 2 value, the larger). The worst single layer (layer 0, ≈ no
overlap) needs 0.974 / 0.944 of top-k × s_q: a buffer of ONE size for all layers, which
the engine allocates today, gains nothing; the saving needs per-layer capacities.

Engine traces of the tiny random-weight model (configs/tiny.py, s_q 1 traces, 4 requests
× 64 steps, union of 2 / 3 consecutive steps) give 0.944 / 0.882 on average and 1.0 / 0.99
at the layer maximum: random weights have almost no step-to-step locality, so they bound
the ratio from above and are not used for the constant. The engine refuses trace_path
with MTP drafts, so no engine trace of a real MTP step exists yet.
"""

from __future__ import annotations

import math

MTP_NEW_FRACTION = 0.40


def union_rows(topk: int, s_q: int, new_fraction: float = MTP_NEW_FRACTION) -> int:
    """Hot rows per request per layer one step with `s_q` query tokens reads (at most
    topk × s_q, at least topk)."""
    if isinstance(s_q, bool) or not isinstance(s_q, int) or s_q < 1:
        raise ValueError(f"s_q={s_q!r} is invalid: allowed a positive integer")
    if not 0.0 <= new_fraction <= 1.0:
        raise ValueError(f"new_fraction={new_fraction!r} is invalid: allowed 0..1")
    return min(topk * s_q, math.ceil(topk * (1 + (s_q - 1) * new_fraction)))


def union_ratio(s_q: int, new_fraction: float = MTP_NEW_FRACTION) -> float:
    """union_rows / (topk × s_q): 1 at s_q 1, 0.70 at s_q 2, 0.60 at s_q 3."""
    return (1 + (s_q - 1) * new_fraction) / s_q
