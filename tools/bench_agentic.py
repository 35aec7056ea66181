"""Agentic replay benchmark: multi-turn coding-agent sessions (long system prompts, tool
results, short replies) replayed against `python -m jlco.serve` through the OpenAI chat,
Responses and Anthropic Messages routes, with the prefix cache on and off.

Sessions come from --trace (the JSON-lines format of `jlco/ops/agentic_trace.py`, also
in docs/agents.md) or are made up (--num_sessions sessions of --min_turns..--max_turns
turns growing to --min_context..--max_context tokens, --output_tokens per reply;
--write_trace saves them). --concurrency sessions run at once, so their turns
interleave; each turn is sent when the session's previous reply has ended. Every route
replays every session (`jlco/ops/agentic_replay.py`), the prefix cache reset between
routes so each starts cold. Per turn: TTFT, ITL, the prompt's tokens and the cached
ones; per session the prefix-hit rate (cached / prompt tokens).

Servers: --url talks to a running one; --config [--override ...] starts one here;
--compare_prefix_cache starts two in turn (never at once), `cache.prefix_cache=true`
and `=false`.

  python tools/bench_agentic.py --config configs/128k.py --compare_prefix_cache \\
      --num_sessions 4 --min_turns 10 --max_turns 10 --min_context 32768 \\
      --max_context 32768

Results go to --out (default out/): bench_agentic.json, bench_agentic.png (TTFT and
cached share by turn) and each started server's stderr; the table goes to stdout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import sys

import numpy as np
from absl import app, flags

from jlco.ops import agentic_replay, agentic_trace, bench_targets, loadgen
from jlco.util import atomic

FLAGS = flags.FLAGS
PROG = "bench_agentic"


def define_flags() -> None:
    bench_targets.define_flags()
    flags.DEFINE_list("routes", list(agentic_replay.ROUTES), "routes to replay through: "
                      f"any of {', '.join(agentic_replay.ROUTES)}")
    flags.DEFINE_string("trace", None, "a JSON-lines trace to replay (else synthetic)")
    flags.DEFINE_string("write_trace", None, "write the synthetic trace here")
    flags.DEFINE_integer("num_sessions", 4, "synthetic sessions")
    flags.DEFINE_integer("min_turns", 10, "synthetic turns per session, at least")
    flags.DEFINE_integer("max_turns", 50, "synthetic turns per session, at most")
    flags.DEFINE_integer("min_context", 32768, "a synthetic session's final context, at least")
    flags.DEFINE_integer("max_context", 131072, "a synthetic session's final context, at most")
    flags.DEFINE_integer("output_tokens", 32, "synthetic reply length (max_tokens)")
    flags.DEFINE_integer("concurrency", 0, "sessions at once (0: all)")
    flags.DEFINE_integer("seed", 0, "synthetic trace and text seed")


def check_flags() -> pathlib.Path:
    bench_targets.at_least(dict(num_sessions=1, min_turns=1, max_turns=1, min_context=16,
                                max_context=16, output_tokens=1, concurrency=0, seed=0))
    for lo, hi in (("min_turns", "max_turns"), ("min_context", "max_context")):
        if getattr(FLAGS, lo) > getattr(FLAGS, hi):
            raise ValueError(f"--{lo}={getattr(FLAGS, lo)} is above --{hi}="
                             f"{getattr(FLAGS, hi)}")
    bad = [r for r in FLAGS.routes if r not in agentic_replay.ROUTES]
    if bad or not FLAGS.routes:
        raise ValueError(f"--routes={','.join(FLAGS.routes)}: allowed a list of "
                         f"{', '.join(agentic_replay.ROUTES)}")
    return bench_targets.check_flags("bench_agentic.json")


def sessions() -> dict[str, list[agentic_trace.Turn]]:
    """The trace to replay: --trace, or the synthetic one (written to --write_trace)."""
    if FLAGS.trace:
        return agentic_trace.read_trace(pathlib.Path(FLAGS.trace), FLAGS.seed)
    lines = agentic_trace.synthetic(FLAGS.num_sessions, (FLAGS.min_turns, FLAGS.max_turns),
                                    (FLAGS.min_context, FLAGS.max_context),
                                    FLAGS.output_tokens, FLAGS.seed)
    if FLAGS.write_trace:
        agentic_trace.write_trace(lines, pathlib.Path(FLAGS.write_trace))
    out: dict[str, list[agentic_trace.Turn]] = {}
    for i, doc in enumerate(lines):
        t = agentic_trace.parse_turn(doc, f"synthetic line {i + 1}", FLAGS.seed)
        out.setdefault(t.session, []).append(t)
    return out


def summarize(route: str, runs: list[dict]) -> dict:
    """Per turn (over the sessions that have it): TTFT and ITL stats, mean prompt and
    cached tokens; per route: the sessions' hit rates."""
    turns = max(len(s["turns"]) for s in runs)
    per_turn = []
    for t in range(turns):
        rows = [s["turns"][t] for s in runs if t < len(s["turns"])]
        per_turn.append(dict(
            turn=t, sessions=len(rows), ttft_s=loadgen.stats([r["ttft_s"] for r in rows]),
            itl_s=loadgen.stats([r["itl_s"] for r in rows if r["itl_s"] is not None]),
            prompt_tokens=float(np.mean([r["prompt_tokens"] for r in rows])),
            cached_tokens=float(np.mean([r["cached_tokens"] for r in rows]))))
    rows = [r for s in runs for r in s["turns"]]
    return dict(route=route, per_turn=per_turn, sessions=runs,
                hit_rate=loadgen.stats([s["hit_rate"] for s in runs]),
                ttft_s=loadgen.stats([r["ttft_s"] for r in rows]),
                itl_s=loadgen.stats([r["itl_s"] for r in rows if r["itl_s"] is not None]),
                output_tokens=sum(r["output_tokens"] for r in rows))


async def run(url: str, trace: dict) -> list[dict]:
    n = FLAGS.concurrency or len(trace)
    out = []
    async with loadgen.client(url, n, FLAGS.api_key, FLAGS.request_timeout_s) as client:
        info = await loadgen.wait_ready(client, FLAGS.server_timeout_s)
        model = info["data"][0]["id"]
        for route in FLAGS.routes:
            await client.post("/v1/reset_prefix_cache")     # each route starts cold
            t0 = asyncio.get_running_loop().time()
            runs = await agentic_replay.replay(client, route, trace, model, n)
            rep = summarize(route, runs)
            rep["duration_s"] = asyncio.get_running_loop().time() - t0
            print(f"{PROG}: {route}: {rep['duration_s']:.1f} s, hit rate "
                  f"{rep['hit_rate']['mean']:.3f}", file=sys.stderr, flush=True)
            out.append(rep)
    return out


def replies_equal(targets: list[dict]) -> bool:
    """Every (server, route) run gave the same replies: greedy, and reuse is exact."""
    runs = [[[t["reply"] for t in s["turns"]] for s in r["sessions"]]
            for x in targets for r in x["routes"]]
    return all(run == runs[0] for run in runs)


def _ms(s: dict) -> str:
    return "-" if s["p50"] is None else f"{s['p50'] * 1e3:.0f}"


def table(targets: list[dict]) -> str:
    """A summary row per (server, route), then TTFT p50 / cached tokens per turn."""
    lines = ["server | route | hit rate | TTFT p50 ms | ITL p50 ms | output tok | s",
             "---|---|---|---|---|---|---"]
    for t in targets:
        for r in t["routes"]:
            lines.append(f"{t['label']} | {r['route']} | {r['hit_rate']['mean']:.3f} | "
                         f"{_ms(r['ttft_s'])} | {_ms(r['itl_s'])} | {r['output_tokens']} | "
                         f"{r['duration_s']:.1f}")
    cols = [(t, r) for t in targets for r in t["routes"]]
    lines += ["", "turn | prompt | " + " | ".join(
        f"{t['label']} {r['route']} TTFT ms / cached" for t, r in cols)]
    for i, row in enumerate(cols[0][1]["per_turn"]):
        cells = [f"{_ms(r['per_turn'][i]['ttft_s'])} / {r['per_turn'][i]['cached_tokens']:.0f}"
                 for _, r in cols]
        lines.append(f"{i} | {row['prompt_tokens']:.0f} | " + " | ".join(cells))
    lines.append(f"replies equal over every server and route: {replies_equal(targets)}")
    return "\n".join(lines)


def plot(targets: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for t in targets:
        for r in t["routes"]:
            turns = [x["turn"] for x in r["per_turn"]]
            label = f"{r['route']}, {t['label']}"
            a.plot(turns, [x["ttft_s"]["p50"] for x in r["per_turn"]], marker="o", label=label)
            b.plot(turns, [x["cached_tokens"] / max(x["prompt_tokens"], 1)
                           for x in r["per_turn"]], marker="o", label=label)
    a.set_xlabel("turn")
    a.set_ylabel("TTFT p50 (s)")
    a.set_yscale("log")
    b.set_xlabel("turn")
    b.set_ylabel("cached / prompt tokens (mean)")
    b.legend(fontsize=7)
    fig.suptitle("agentic replay")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv) -> int:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)   # no line per request
    try:
        out = check_flags()
        trace = sessions()
    except (ValueError, OSError) as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    targets = bench_targets.run_targets(
        lambda url: {"routes": asyncio.run(run(url, trace))}, out, PROG, "server_agentic")
    names = ("routes", "trace", "num_sessions", "min_turns", "max_turns", "min_context",
             "max_context", "output_tokens", "concurrency", "seed", "config", "override")
    report = dict(flags={k: FLAGS[k].value for k in names}, machine=loadgen.machine(),
                  sessions={n: len(t) for n, t in trace.items()}, targets=targets,
                  replies_equal=replies_equal(targets))
    atomic.write_text(out / "bench_agentic.json", json.dumps(report, indent=1))
    plot(targets, out / "bench_agentic.png")
    print(table(targets))
    return 0 if report["replies_equal"] else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
