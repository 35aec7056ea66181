"""Replay a top-k trace against LRU, FIFO and Belady's MIN over hot-buffer sizes.

Semantics (`jlco.planning.trace.replay`): per request and layer, step t needs its whole set U_t
(distinct ids >= 0) at once; every id of U_t is one lookup and hits if resident when the
step starts; misses are inserted and, over capacity, victims come only from rows outside
U_t (rows serving the current step are pinned), so capacity >= max |U_t| (>= topk).
LRU evicts the least recently used row, FIFO the earliest inserted, Belady the row whose
next use is farthest (optimal: an upper bound for any online policy). Hit rates are
hits / lookups summed over requests, per layer, after `--warmup` steps.

  python tools/cache_study.py --synthetic --context 8192 --topk 512 --layers 61 \
      --steps 48 --capacities 512,1024,2048,4096 --out out/cache_study
  python tools/cache_study.py --trace run.trace --capacities 2048,4096
  python tools/cache_study.py --trace run.trace --union_window 2   # MTP s_q 2 union

--union_window N adds `union`: how much of top-k x s_q the distinct ids of N consecutive
records fill (`jlco.planning.trace.union_ratios`; engine traces are s_q = 1, so N = s_q
emulates an MTP step whose drafts were accepted; synthetic --queries_per_step traces
already record each step's union, use N = 1). This is where `jlco.planning.mtp`'s
union ratio comes from.

Prints a table (or the JSON with --json); --out DIR (default out/cache_study, '' = none)
receives cache_study.json and cache_study.png.
"""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np
from absl import app, flags

from jlco.planning import trace
from jlco.util import atomic, cli

FLAGS = flags.FLAGS
PROG = "cache_study"


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("trace", "", "trace file written by jlco.planning.trace.TraceWriter")
    flags.DEFINE_bool("synthetic", False, "generate an ESS-shaped synthetic trace instead")
    flags.DEFINE_integer("context", 8192, "synthetic: context tokens", lower_bound=1)
    flags.DEFINE_integer("topk", 512, "synthetic: top-k (<= --context)", lower_bound=1)
    flags.DEFINE_integer("layers", 61, "synthetic: layers", lower_bound=1)
    flags.DEFINE_integer("steps", 48, "synthetic: decode steps", lower_bound=1)
    flags.DEFINE_integer("requests", 1, "synthetic: requests", lower_bound=1)
    flags.DEFINE_integer("queries_per_step", 1, "synthetic: s_q (1 + MTP drafts)", lower_bound=1)
    flags.DEFINE_float("accept", 1.0, "synthetic: mean accepted tokens per step "
                       "(1..queries_per_step)", lower_bound=1.0)
    flags.DEFINE_integer("seed", 0, "synthetic: seed", lower_bound=0)
    flags.DEFINE_list("capacities", [], "hot-buffer rows per request per layer (default: "
                      "1, 1.5, 2, 3, 4 x the largest step set)")
    flags.DEFINE_list("policies", list(trace.POLICIES), "policies to replay")
    flags.DEFINE_integer("warmup", 0, "steps replayed but not counted", lower_bound=0)
    flags.DEFINE_integer("union_window", 0, "also report the union of N consecutive records' "
                         "ids over N x s_q x topk (0 = no)", lower_bound=0)
    flags.DEFINE_bool("json", False, "print JSON instead of the table")
    flags.DEFINE_string("out", "out/cache_study", "directory for cache_study.json and a "
                        "PNG of hit rate vs capacity ('' = none)")


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


def _union_table(u: dict) -> str:
    lines = [f"union of {u['window']} record(s) x s_q {u['queries_per_step']} over "
             f"(that x topk {u['topk']}): per layer mean / p99 / max",
             *(f"{l:>5} {d['mean']:>8.3f} {d['p99']:>8.3f} {d['max']:>8.3f}"
               for l, d in u["layers"].items()),
             f"all layers: mean {u['mean']:.3f}, mean of layer max "
             f"{u['mean_of_layer_max']:.3f}, max {u['max']:.3f}"]
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
    with atomic.temp_sibling(path) as tmp:   # never a half-written PNG
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def _capacities(values) -> list[int]:
    try:
        caps = [int(c) for c in values]
    except ValueError:
        caps = []
    if len(caps) != len(values) or any(c < 1 for c in caps):
        raise ValueError(f"--capacities={','.join(values)} is invalid: allowed a "
                         "comma-separated list of positive integers")
    return caps


def _check_flags() -> None:
    """Flag combinations absl's per-flag bounds cannot see; bad ones name the flag."""
    if bool(FLAGS.trace) == FLAGS.synthetic:
        raise ValueError("give exactly one of --trace PATH or --synthetic")
    bad = [p for p in FLAGS.policies if p not in trace.POLICIES]
    if bad or not FLAGS.policies:
        raise ValueError(f"--policies={','.join(FLAGS.policies)} is invalid: allowed a "
                         f"comma-separated subset of {', '.join(trace.POLICIES)}")
    if FLAGS.synthetic and FLAGS.topk > FLAGS.context:
        raise ValueError(f"--topk={FLAGS.topk} is invalid: allowed <= --context "
                         f"({FLAGS.context})")
    if FLAGS.synthetic and FLAGS.accept > FLAGS.queries_per_step:
        raise ValueError(f"--accept={FLAGS.accept} is invalid: allowed 1..--queries_per_step "
                         f"({FLAGS.queries_per_step})")
    if FLAGS.trace and not pathlib.Path(FLAGS.trace).is_file():
        raise ValueError(f"--trace={FLAGS.trace!r}: no such file")
    if FLAGS.out:
        atomic.check_writable(FLAGS.out, "--out")


def _load_trace() -> trace.Trace:
    if FLAGS.synthetic:
        return trace.synthetic_trace(FLAGS.context, FLAGS.topk, FLAGS.layers, FLAGS.steps,
                                     FLAGS.requests, queries_per_step=FLAGS.queries_per_step,
                                     accept=FLAGS.accept, seed=FLAGS.seed)
    try:
        return trace.read_trace(FLAGS.trace)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--trace={FLAGS.trace!r}: damaged trace header ({err})") from None


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    with cli.errors_exit(PROG, ValueError, OSError):
        _check_flags()
        caps = _capacities(FLAGS.capacities)
        tr = _load_trace()
        caps = caps or _default_caps(tr)
        out = study(tr, caps, FLAGS.policies, FLAGS.warmup)
        if FLAGS.union_window:
            out["union"] = trace.union_ratios(tr, FLAGS.union_window, warmup=FLAGS.warmup)
        if FLAGS.out:
            pathlib.Path(FLAGS.out).mkdir(parents=True, exist_ok=True)
            _plot(out, pathlib.Path(FLAGS.out) / "cache_study.png")
            atomic.write_text(pathlib.Path(FLAGS.out) / "cache_study.json",
                              cli.report_json(out) + "\n")
    text = _table(out) + ("\n" + _union_table(out["union"]) if "union" in out else "")
    print(cli.report_json(out) if FLAGS.json else text)


if __name__ == "__main__":
    define_flags()
    app.run(main)
