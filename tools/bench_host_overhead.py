"""How much of a decode step is engine host work, per batch size.

The engine queues each decode step on the device (JAX async dispatch) and does the host
work around it — scheduling, building the step's inputs, dispatch, prefill pieces while
the device computes, reading the tokens back, stop checks — so what matters is the host
time that does NOT overlap the device: `Engine.host_seconds` (a step's wall time minus
the time it spent blocked waiting for the device). This tool fills every slot with a
request, decodes, and reports per batch size the step wall time p50, the host time p50
and their ratio (target: < 10 %), as JSON + table + PNG.

    python tools/bench_host_overhead.py --config configs/bench_small.py --batches 1,16,64

On CPU the "device" is the same CPU, so the device time includes XLA's own thread
scheduling; on a GPU the same numbers separate Python from kernels.
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
PROG = "bench_host_overhead"


def define_flags() -> None:
    flags.DEFINE_string("config", str(ROOT / "configs" / "bench_small.py"), "config file")
    flags.DEFINE_list("batches", ["1", "16", "64"], "batch sizes (every slot busy)")
    flags.DEFINE_integer("prompt_len", 256, "prompt tokens per request", lower_bound=1)
    flags.DEFINE_integer("steps", 24, "timed decode steps per batch size", lower_bound=2)
    flags.DEFINE_integer("active", 0, "busy slots (0 = every slot of the batch)", lower_bound=0)
    flags.DEFINE_integer("context", 0, "engine.max_context_len (0 = just enough for the "
                         "prompts; give the config's to measure its long-context step)",
                         lower_bound=0)
    flags.DEFINE_bool("offload", True, "latent cache in host memory")
    flags.DEFINE_string("out", None, "output directory (default out/bench_host_overhead)")
    flags.DEFINE_bool("json", False, "print the JSON on stdout (the table goes to stderr)")


def measure(cfg, model, batch: int) -> dict:
    from jlco.engine.core import Engine
    from jlco.planning import roofline
    ctx = FLAGS.context or FLAGS.prompt_len + FLAGS.steps + 8
    cfg = cfg.replace(engine__max_batch_size=batch, engine__max_context_len=ctx)
    active = min(FLAGS.active or batch, batch)
    eng = Engine(cfg, model)
    try:
        vocab = cfg.model.vocab_size
        prompts = [[(31 * r + 7 * i) % vocab for i in range(FLAGS.prompt_len)]
                   for r in range(active)]
        for p in prompts:
            eng.submit(p, FLAGS.steps + 4)
        eng.admit()                       # prefill everything first: time decode only
        eng.step()                        # compile
        eng.step_seconds.clear()
        eng.host_seconds.clear()
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            eng.step()
        wall = (time.perf_counter() - t0) / FLAGS.steps
        step = statistics.median(eng.step_seconds)
        host = statistics.median(eng.host_seconds)
        eng.check_no_leaks()
    finally:
        eng.close()
    # The machine's limit for the same work: bytes / bandwidth, FLOPs / peak (drafts
    # make s_q = 1 + num_draft_tokens query tokens per request).
    roof = roofline.decode_step_cost(cfg, active, FLAGS.prompt_len + FLAGS.steps // 2,
                                     s_q=1 + cfg.engine.num_draft_tokens)
    roof_s = roof.time_s(roofline.cpu_machine())
    return {"batch": batch, "active": active, "context": ctx, "step_ms_p50": step * 1e3,
            "loop_ms_mean": wall * 1e3, "host_ms_p50": host * 1e3,
            "host_share": host / step if step else None,
            "roofline_ms": roof_s * 1e3, "step_over_roofline": step / roof_s}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    with cli.errors_exit(PROG, ValueError, OSError):
        from jlco.checkpoint.choice import load_weights
        from jlco.config import load_config
        from jlco.launch.load import random_choice
        try:
            batches = [int(b) for b in FLAGS.batches]
        except ValueError:
            raise ValueError(f"--batches={','.join(FLAGS.batches)!r} is invalid: allowed "
                             "comma-separated integers >= 1") from None
        if not batches or min(batches) < 1:
            raise ValueError(f"--batches={','.join(FLAGS.batches)!r} is invalid: allowed "
                             "comma-separated integers >= 1")
        base = load_config(FLAGS.config).replace(cache__offload=FLAGS.offload)
        choice = random_choice(base, None, 0)
        cfg = base.replace(model=choice.model)
        _, model = load_weights(choice)
    import jax
    rows = []
    for b in batches:
        print(f"{PROG}: batch {b} ...", file=sys.stderr, flush=True)
        rows.append(measure(cfg, model, b))
    out = pathlib.Path(FLAGS.out or ROOT / "out" / "bench_host_overhead")
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": cfg.name, "offload": FLAGS.offload, "prompt_len": FLAGS.prompt_len,
              "steps": FLAGS.steps, "machine": {"platform": platform.platform(),
                                                "device": str(jax.devices()[0]),
                                                "cpus": __import__("os").cpu_count()},
              "rows": rows}
    _plot(rows, out / "bench_host_overhead.png")
    lines = [f"{'batch':>6} {'active':>6} {'step ms p50':>12} {'host ms p50':>12} "
             f"{'host share':>11} {'roofline ms':>12} {'x roofline':>11}"]
    for r in rows:
        lines.append(f"{r['batch']:>6} {r['active']:>6} {r['step_ms_p50']:>12.2f} "
                     f"{r['host_ms_p50']:>12.3f} {100 * r['host_share']:>10.1f}% "
                     f"{r['roofline_ms']:>12.3f} {r['step_over_roofline']:>11.1f}")
    cli.write_report(out / "bench_host_overhead.json", report, "\n".join(lines), FLAGS.json)


def _plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [str(r["batch"]) for r in rows]
    host = [r["host_ms_p50"] for r in rows]
    dev = [r["step_ms_p50"] - r["host_ms_p50"] for r in rows]
    ax.bar(xs, dev, label="waiting on the device")
    ax.bar(xs, host, bottom=dev, label="host (not overlapped)")
    for x, r in zip(xs, rows):
        ax.text(x, r["step_ms_p50"], f"{100 * r['host_share']:.1f}%", ha="center", va="bottom")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode step, ms (p50)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
