"""Replay a top-k trace against LRU, FIFO and Belady's MIN over hot-buffer sizes.

Semantics (`jlco.planning.trace.replay`): per request and layer, step t needs its whole set U_t
(distinct ids >= 0) at once; every id of U_t is one lookup and hits if resident when the
step starts; misses are inserted and, over capacity, victims come only from rows outside
U_t (rows serving the current step are pinned), so capacity >= max |U_t| (>= topk).
LRU evicts the least recently used row, FIFO the earliest inserted, Belady the row whose
next use is farthest (optimal: an upper bound for any online policy). Hit rates are
hits / lookups summed over requests, per layer, after `--warmup` steps.

  python tools/cache_study.py --synthetic --context 8192 --topk 512 --layers 61 \
      --steps 48 --capacities 512,1024,2048,4096 --json --plot out/cache.png
  python tools/cache_study.py --trace run.trace --capacities 2048,4096
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags

from jlco.planning import trace

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("trace", "", "trace file written by jlco.planning.trace.TraceWriter")
    flags.DEFINE_bool("synthetic", False, "generate an ESS-shaped synthetic trace instead")
    flags.DEFINE_integer("context", 8192, "synthetic: context tokens")
    flags.DEFINE_integer("topk", 512, "synthetic: top-k")
    flags.DEFINE_integer("layers", 61, "synthetic: layers")
    flags.DEFINE_integer("steps", 48, "synthetic: decode steps")
    flags.DEFINE_integer("requests", 1, "synthetic: requests")
    flags.DEFINE_integer("queries_per_step", 1, "synthetic: s_q (1 + MTP drafts)")
    flags.DEFINE_float("accept", 1.0, "synthetic: mean accepted tokens per step")
    flags.DEFINE_integer("seed", 0, "synthetic: seed")
    flags.DEFINE_list("capacities", [], "hot-buffer rows per request per layer (default: "
                      "1, 1.5, 2, 3, 4 x the largest step set)")
    flags.DEFINE_list("policies", list(trace.POLICIES), "policies to replay")
    flags.DEFINE_integer("warmup", 0, "steps replayed but not counted")
    flags.DEFINE_bool("json", False, "print JSON instead of the table")
    flags.DEFINE_string("plot", "", "write a PNG of hit rate vs capacity here")


def study(tr: trace.Trace, capacities: list[int], policies=trace.POLICIES,
          warmup: int = 0) -> dict:
    """{policy: {capacity: {layer: hit_rate}}} plus lookups per layer."""
    for p in policies:
        if p not in trace.POLICIES:
            raise ValueError(f"policy {p!r} is invalid: allowed {trace.POLICIES}")
    res = {p: {c: {} for c in capacities} for p in policies}
    lookups = {}
    by_layer: dict[int, list] = {}
    for r, l in tr.keys():
        by_layer.setdefault(l, []).append(tr.sets(r, l))
    for l, seqs in sorted(by_layer.items()):
        for p in policies:
            for c in capacities:
                stats = [trace.replay(s, c, p, warmup) for s in seqs]
                n = sum(s.lookups for s in stats)
                res[p][c][l] = sum(s.hits for s in stats) / n if n else float("nan")
                lookups[l] = n
    return dict(hit_rate=res, lookups=lookups)


def _default_caps(tr: trace.Trace) -> list[int]:
    need = max(len(np.unique(tr.ids[a:b][tr.ids[a:b] >= 0]))
               for a, b in zip(tr.offsets[:-1], tr.offsets[1:]))
    return sorted({int(need * f) for f in (1, 1.5, 2, 3, 4)})


def _table(out: dict) -> str:
    lines = []
    for p, per_cap in out["hit_rate"].items():
        caps = list(per_cap)
        layers = sorted(per_cap[caps[0]])
        lines.append(f"{p}: hit rate per layer (columns = capacity)")
        lines.append("layer " + " ".join(f"{c:>8}" for c in caps))
        for l in layers:
            lines.append(f"{l:>5} " + " ".join(f"{per_cap[c][l]:>8.3f}" for c in caps))
        lines.append("mean  " + " ".join(f"{np.mean(list(per_cap[c].values())):>8.3f}"
                                         for c in caps))
    return "\n".join(lines)


def _plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for p, per_cap in out["hit_rate"].items():
        caps = list(per_cap)
        ax.plot(caps, [np.mean(list(per_cap[c].values())) for c in caps], marker="o", label=p)
    ax.set(xlabel="hot-buffer rows per request per layer", ylabel="hit rate (mean of layers)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv) -> None:
    del argv
    if bool(FLAGS.trace) == FLAGS.synthetic:
        raise app.UsageError("give exactly one of --trace PATH or --synthetic")
    if FLAGS.synthetic:
        tr = trace.synthetic_trace(FLAGS.context, FLAGS.topk, FLAGS.layers, FLAGS.steps,
                                   FLAGS.requests, queries_per_step=FLAGS.queries_per_step,
                                   accept=FLAGS.accept, seed=FLAGS.seed)
    else:
        tr = trace.read_trace(FLAGS.trace)
    caps = [int(c) for c in FLAGS.capacities] or _default_caps(tr)
    out = study(tr, caps, FLAGS.policies, FLAGS.warmup)
    if FLAGS.plot:
        _plot(out, FLAGS.plot)
    print(json.dumps(out, indent=1) if FLAGS.json else _table(out))


if __name__ == "__main__":
    define_flags()
    app.run(main)
