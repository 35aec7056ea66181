"""Offload on against offload off at equal batch, measured so that load elsewhere on the
machine cannot move the ratio: both engines live in one process, hold the same model
and the same requests, and their decode steps alternate (off, on, off, on, ...), so a
burst of load hits both. Reported: each engine's step p50, the ratio of the p50s, the
median of the per-pair ratios (on_i / off_i) with its spread, the hot-buffer hit rate,
and the roofline of the step (bytes ÷ bandwidth, FLOPs ÷ peak) — JSON + table + PNG.

    python tools/bench_offload_ratio.py                       # bench_mid, 4 x 2048 tokens
    python tools/bench_offload_ratio.py --staging 512         # a hot buffer of 2 x top-k

`--staging 0` is the config's hot buffer (the minimum: top-k rows per request and layer,
the tightest setting); the issue's target is on/off <= 1.10 at equal batch.
"""

from __future__ import annotations

import pathlib
import platform
import statistics
import sys
import time

from absl import app, flags, logging

from jlco.util import cli, compile_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
PROG = "bench_offload_ratio"


def define_flags() -> None:
    flags.DEFINE_string("config", str(ROOT / "configs" / "bench_mid.py"), "config file")
    flags.DEFINE_integer("batch", 4, "requests (every slot busy)", lower_bound=1)
    flags.DEFINE_integer("prompt_len", 2048, "prompt tokens per request", lower_bound=1)
    flags.DEFINE_integer("steps", 16, "timed decode steps per engine", lower_bound=2)
    flags.DEFINE_integer("staging", 0, "cache.hot_buffer_rows, hot-buffer rows per request "
                         "and layer (0 = the config's, at least top-k)", lower_bound=0)
    flags.DEFINE_string("out", None, "output directory (default out/bench_offload_ratio)")
    flags.DEFINE_bool("json", False, "print the JSON on stdout (the table goes to stderr)")


def _engine(cfg, model, offload: bool):
    from jlco.engine.core import Engine
    # The two engines step in turn: a step left in flight (async scheduling) would
    # run beside the other engine's and time both wrong.
    eng = Engine(cfg.replace(cache__offload=offload, engine__async_scheduling=False), model)
    vocab = cfg.model.vocab_size
    for r in range(FLAGS.batch):
        eng.submit([(31 * r + 7 * i + 3) % vocab for i in range(FLAGS.prompt_len)],
                   FLAGS.steps + 4)
    eng.admit()          # prefill first: only decode steps are timed
    eng.step()           # compile
    eng.step_seconds.clear()
    return eng


def measure(cfg, model) -> dict:
    from jlco.planning import roofline
    print(f"{PROG}: prefilling {FLAGS.batch} x {FLAGS.prompt_len} tokens twice ...",
          file=sys.stderr, flush=True)
    off, on = _engine(cfg, model, False), _engine(cfg, model, True)
    try:
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            off.step()
            on.step()
        wall = time.perf_counter() - t0
        t_off, t_on = off.step_seconds[:FLAGS.steps], on.step_seconds[:FLAGS.steps]
        pairs = sorted(b / a for a, b in zip(t_off, t_on))
        same = [r.tokens for r in on.scheduler.requests.values()] == \
               [r.tokens for r in off.scheduler.requests.values()]
        snap = on.metrics.snapshot()["total"]
        for eng in (off, on):
            eng.check_no_leaks()
    finally:
        off.close()
        on.close()
    roof = roofline.decode_step_cost(cfg, FLAGS.batch, FLAGS.prompt_len + FLAGS.steps // 2)
    roof_ms = roof.time_s(roofline.cpu_machine()) * 1e3
    p_off, p_on = statistics.median(t_off) * 1e3, statistics.median(t_on) * 1e3
    q = len(pairs) // 4
    return {"off_ms_p50": p_off, "on_ms_p50": p_on, "ratio_of_p50": p_on / p_off,
            "pair_ratio_median": statistics.median(pairs),
            "pair_ratio_iqr": [pairs[q], pairs[-1 - q]], "tokens_equal": same,
            "hit_rate": snap["hit_rate"], "roofline_ms": roof_ms,
            "off_over_roofline": p_off / roof_ms, "on_over_roofline": p_on / roof_ms,
            "wall_s": wall, "off_steps_ms": [t * 1e3 for t in t_off],
            "on_steps_ms": [t * 1e3 for t in t_on]}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    with cli.errors_exit(PROG, ValueError, OSError):
        from jlco.checkpoint.choice import load_weights
        from jlco.config import load_config
        from jlco.launch.load import random_choice
        base = load_config(FLAGS.config)
        over = dict(engine__max_batch_size=FLAGS.batch,
                    engine__max_context_len=FLAGS.prompt_len + FLAGS.steps + 8)
        if FLAGS.staging:
            over["cache__hot_buffer_rows"] = FLAGS.staging
        base = base.replace(**over)
        choice = random_choice(base, None, 0)
        cfg = base.replace(model=choice.model)
        _, model = load_weights(choice)
    import jax
    r = measure(cfg, model)
    out = pathlib.Path(FLAGS.out or ROOT / "out" / "bench_offload_ratio")
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": cfg.name, "batch": FLAGS.batch, "prompt_len": FLAGS.prompt_len,
              "steps": FLAGS.steps, "hot_buffer_rows": cfg.hot_buffer_rows,
              "topk": cfg.model.index_topk,
              "machine": {"platform": platform.platform(), "device": str(jax.devices()[0]),
                          "cpus": __import__("os").cpu_count()}, **r}
    _plot(r, out / "bench_offload_ratio.png")
    table = (f"{'off ms p50':>11} {'on ms p50':>10} {'on/off':>7} {'pairs p50 [IQR]':>22} "
             f"{'hit rate':>9} {'roofline ms':>12} {'off x roof':>11} {'on x roof':>10} "
             f"{'same tokens':>11}\n"
             f"{r['off_ms_p50']:>11.2f} {r['on_ms_p50']:>10.2f} {r['ratio_of_p50']:>7.3f} "
             f"{r['pair_ratio_median']:>7.3f} [{r['pair_ratio_iqr'][0]:.3f}, "
             f"{r['pair_ratio_iqr'][1]:.3f}] {r['hit_rate']:>9.3f} {r['roofline_ms']:>12.2f} "
             f"{r['off_over_roofline']:>11.1f} {r['on_over_roofline']:>10.1f} "
             f"{str(r['tokens_equal']):>11}")
    cli.write_report(out / "bench_offload_ratio.json", report, table, FLAGS.json)


def _plot(r: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(1, len(r["off_steps_ms"]) + 1)
    ax.plot(xs, r["off_steps_ms"], "o-", label="offload off")
    ax.plot(xs, r["on_steps_ms"], "s-", label="offload on")
    ax.axhline(r["roofline_ms"], color="grey", ls="--", label="roofline")
    ax.set_xlabel("decode step (alternating engines)")
    ax.set_ylabel("step, ms")
    ax.set_title(f"on/off p50 {r['ratio_of_p50']:.3f}, hit rate {r['hit_rate']:.2f}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
