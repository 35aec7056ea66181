"""Multi-turn benchmark: sessions that grow, against `python -m jlco.serve`, with the
prefix cache on and off.

A session of --turns turns: turn 1 sends --first_len random token ids; each next turn
sends the whole history (every earlier prompt and answer) plus --add_len new tokens, as a
chat or agent client does. Every request is a streamed greedy /v1/completions of
--max_tokens tokens (ignore_eos). --num_sessions sessions run concurrently, each turn
sent when the session's previous answer has ended. Per turn: TTFT p50/p99 over the
sessions, the prompt length and `usage.prompt_tokens_details.cached_tokens`; per run:
output tokens/s and the whole run's time.

Servers: --url talks to a running one; --config [--override ...] starts one here;
--compare_prefix_cache starts two in turn (never at once: they would share the CPU), with
`cache.prefix_cache=true` and `=false`, and reports them side by side: the TTFT ratio
per turn (on / off) and whether every turn's tokens are equal (they must be: reuse is
exact).

  python tools/bench_multiturn.py --config configs/128k.py --compare_prefix_cache \\
      --turns 4 --first_len 8192 --add_len 512 --max_tokens 16

Results go to --out (default out/): bench_multiturn.json, bench_multiturn.png (TTFT by
turn) and each started server's stderr; the table goes to stdout.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import numpy as np
from absl import app, flags

from jlco.ops import bench_targets, loadgen
from jlco.util import atomic

FLAGS = flags.FLAGS
PROG = "bench_multiturn"


def define_flags() -> None:
    bench_targets.define_flags()
    flags.DEFINE_integer("num_sessions", 1, "concurrent sessions")
    flags.DEFINE_integer("turns", 4, "turns per session")
    flags.DEFINE_integer("first_len", 8192, "prompt tokens of the first turn")
    flags.DEFINE_integer("add_len", 512, "new tokens each next turn adds")
    flags.DEFINE_integer("max_tokens", 16, "answer tokens per turn")
    flags.DEFINE_integer("seed", 0, "prompt seed")


def check_flags() -> pathlib.Path:
    bench_targets.at_least(dict(num_sessions=1, turns=1, first_len=1, add_len=1,
                                max_tokens=1, seed=0))
    return bench_targets.check_flags("bench_multiturn.json")


async def session(client, rng: np.random.Generator) -> list[dict]:
    """One session's turns → per turn {prompt_len, ttft_s, e2e_s, cached_tokens, tokens}."""
    hist, turns = [], []
    for t in range(FLAGS.turns):
        hist = hist + rng.integers(0, loadgen.PROMPT_VOCAB,
                                   FLAGS.first_len if t == 0 else FLAGS.add_len).tolist()
        body = loadgen.make_body(hist, FLAGS.max_tokens, 0)
        res = await loadgen.stream_one(client, body, loadgen.Result())
        if res.error:
            raise loadgen.LoadError(f"turn {t + 1}: {res.error}")
        turns.append(dict(prompt_len=len(hist), ttft_s=res.ttft, e2e_s=res.t_end - res.t_send,
                          cached_tokens=res.cached_tokens, tokens=list(res.token_ids)))
        hist = hist + list(res.token_ids)
    return turns


async def run(url: str) -> dict:
    async with loadgen.client(url, FLAGS.num_sessions, FLAGS.api_key,
                              FLAGS.request_timeout_s) as client:
        await loadgen.wait_ready(client, FLAGS.server_timeout_s)
        t0 = asyncio.get_running_loop().time()
        rngs = [np.random.default_rng([FLAGS.seed, i]) for i in range(FLAGS.num_sessions)]
        sessions = await asyncio.gather(*(session(client, r) for r in rngs))
        dur = asyncio.get_running_loop().time() - t0
    per_turn = []
    for t in range(FLAGS.turns):
        rows = [s[t] for s in sessions]
        per_turn.append(dict(turn=t + 1, prompt_len=rows[0]["prompt_len"],
                             ttft_s=loadgen.stats([r["ttft_s"] for r in rows]),
                             cached_tokens=[r["cached_tokens"] for r in rows]))
    out_tokens = sum(len(r["tokens"]) for s in sessions for r in s)
    return dict(url=url, duration_s=dur, output_tokens_per_s=out_tokens / dur,
                turns=per_turn, tokens=[[r["tokens"] for r in s] for s in sessions])


def compare(on: dict, off: dict) -> dict:
    ratios = [a["ttft_s"]["p50"] / b["ttft_s"]["p50"] for a, b in zip(on["turns"], off["turns"])]
    return dict(ttft_p50_ratio_by_turn=ratios, tokens_equal=on["tokens"] == off["tokens"],
                throughput_ratio=on["output_tokens_per_s"] / off["output_tokens_per_s"])


def table(runs: list[dict], cmp: dict | None) -> str:
    head = ["turn", "prompt"] + [f"{r['label']} TTFT p50 ms / cached" for r in runs]
    if cmp:
        head.append("TTFT on/off")
    lines = [" | ".join(head)]
    for t in range(FLAGS.turns):
        row = [str(t + 1), str(runs[0]["turns"][t]["prompt_len"])]
        for r in runs:
            x = r["turns"][t]
            row.append(f"{x['ttft_s']['p50'] * 1e3:.0f} / {x['cached_tokens'][0]}")
        if cmp:
            row.append(f"{cmp['ttft_p50_ratio_by_turn'][t]:.3f}")
        lines.append(" | ".join(row))
    for r in runs:
        lines.append(f"{r['label']}: {r['output_tokens_per_s']:.2f} output tok/s, "
                     f"{r['duration_s']:.1f} s")
    if cmp:
        lines.append(f"tokens equal on / off: {cmp['tokens_equal']}")
    return "\n".join(lines)


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        turns = [x["turn"] for x in r["turns"]]
        ax.plot(turns, [x["ttft_s"]["p50"] for x in r["turns"]], marker="o", label=r["label"])
    ax.set_xticks([x["turn"] for x in runs[0]["turns"]])
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"first turn {FLAGS.first_len} tokens, +{FLAGS.add_len} per turn")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv) -> int:
    del argv
    try:
        out = check_flags()
    except ValueError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        return 2
    runs = bench_targets.run_targets(lambda url: asyncio.run(run(url)), out, PROG, "server")
    cmp = compare(*runs) if FLAGS.compare_prefix_cache else None
    report = dict(flags={k: FLAGS[k].value for k in ("num_sessions", "turns", "first_len",
                                                     "add_len", "max_tokens", "seed",
                                                     "config", "override")},
                  machine=loadgen.machine(), runs=runs, comparison=cmp)
    atomic.write_text(out / "bench_multiturn.json", json.dumps(report, indent=1))
    plot(runs, out / "bench_multiturn.png")
    print(table(runs, cmp))
    return 0 if cmp is None or cmp["tokens_equal"] else 1


if __name__ == "__main__":
    define_flags()
    app.run(main)
