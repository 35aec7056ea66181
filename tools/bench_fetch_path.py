"""Warm decode step time of the two miss-fetch paths (cache.fetch_path in_jit vs
host_driven) on the same workload, steps interleaved so machine noise hits both alike.
Also checks that both paths produced the same tokens and the same hits.

  python tools/bench_fetch_path.py --config=configs/tiny.py --batch=2

Results: a table on stdout and bench_fetch_path.json in --out (a directory, default out/
in the repository); --json prints the JSON on stdout instead (table on stderr). Each
path's step time comes with two ratios: `roofline_fraction` (the step's roofline time,
`jlco.planning.roofline`, over the measured median: CPU limits from --mem_gbps /
--peak_gflops (default: measured on this machine), accelerators from their hardware profile) and host_driven over in_jit.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32
from jlco.planning import roofline
from jlco.util import atomic, cli, compile_cache

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_fetch_path"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module runs as a program (as the other tools)."""
    flags.DEFINE_string("config", "configs/tiny.py", "model/cache config to start from")
    flags.DEFINE_integer("batch", 2, "requests decoded together")
    flags.DEFINE_integer("prompt", 150, "prompt tokens of the first request (+10 per request)")
    flags.DEFINE_integer("steps", 40, "timed decode steps (median reported)")
    flags.DEFINE_integer("warmup", 12, "untimed steps first (compiles, hot-buffer fill)")
    flags.DEFINE_enum("impl", "xla", ["xla", "auto", "pallas", "interpret"],
                      "attention/indexer impl (pallas needs a GPU/TPU)")
    flags.DEFINE_string("out", None, "output directory for bench_fetch_path.json (default: "
                        "out/ in the repository)")
    flags.DEFINE_bool("json", False, "print the JSON on stdout (the table goes to stderr)")
    flags.DEFINE_float("mem_gbps", None, "CPU memory bandwidth, GB/s "
                       "(roofline on cpu; default: measured on this machine)")
    flags.DEFINE_float("peak_gflops", None, "CPU peak GFLOP/s "
                       "(roofline on cpu; default: measured on this machine)")


PATHS = ("in_jit", "host_driven")


def _machine() -> roofline.Machine:
    dev = jax.devices()[0]
    key = None if dev.platform == "cpu" else roofline.profile_for_device_kind(dev.device_kind)
    if key is None:
        return roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    return roofline.hardware_machine(key)


def _resolve_config(path: str) -> pathlib.Path:
    p = pathlib.Path(path).expanduser()
    if p.is_absolute() or p.is_file():
        return p
    alt = REPO / p
    return alt if alt.is_file() else p


def _check_flags():
    for name, low in (("batch", 1), ("prompt", 1), ("steps", 1), ("warmup", 0)):
        if getattr(FLAGS, name) < low:
            raise ValueError(f"--{name}={getattr(FLAGS, name)}: allowed an integer >= {low}")
    if FLAGS.impl == "pallas" and jax.default_backend() == "cpu":
        raise ValueError("--impl=pallas needs a GPU or TPU (this backend is cpu): use "
                         "--impl=interpret (Pallas interpret mode, slow) or --impl=xla")
    for name in ("mem_gbps", "peak_gflops"):
        v = getattr(FLAGS, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name}={v}: allowed a positive number (or none: measured "
                             "on this machine)")
    out = pathlib.Path(FLAGS.out).expanduser() if FLAGS.out else REPO / "out"
    if out.suffix == ".json":
        raise ValueError(f"--out={FLAGS.out}: takes a directory (the JSON is written to "
                         "DIR/bench_fetch_path.json)")
    atomic.check_writable(out / "bench_fetch_path.json", "--out")
    out.mkdir(parents=True, exist_ok=True)
    b = FLAGS.batch
    new = FLAGS.warmup + FLAGS.steps + 2
    longest = FLAGS.prompt + 10 * (b - 1) + new
    cfg = load_config(_resolve_config(FLAGS.config)).replace(
        engine__attention_impl=FLAGS.impl, engine__max_batch_size=b,
        engine__max_context_len=longest, cache__offload=True)
    return cfg, out


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    with cli.errors_exit(PROG, ValueError, OSError):
        cfg, out = _check_flags()
    b = FLAGS.batch
    new = FLAGS.warmup + FLAGS.steps + 2
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, cfg.model.vocab_size, FLAGS.prompt + 10 * i)))
               for i in range(b)]
    # Stepped in turn: a step left in flight (async scheduling) would run beside the
    # other engine's.
    engines = {p: Engine(cfg.replace(cache__fetch_path=p, engine__async_scheduling=False),
                         model) for p in PATHS}
    reqs = {}
    for path, eng in engines.items():
        reqs[path] = [eng.submit(p, new) for p in prompts]
        for _ in range(FLAGS.warmup):
            eng.step()
        eng.metrics.reset()
        eng.step_seconds.clear()
    waits = {p: [] for p in PATHS}
    for _ in range(FLAGS.steps):
        for p, eng in engines.items():
            w0 = eng.metrics.snapshot()["total"]["fetch_wait_s"]
            eng.step()
            waits[p].append(eng.metrics.snapshot()["total"]["fetch_wait_s"] - w0)
    tokens = {p: [list(r.tokens) for r in rs] for p, rs in reqs.items()}
    if tokens["in_jit"] != tokens["host_driven"]:
        cli.fail(PROG, "the two fetch paths produced different tokens", cli.FAILURE_EXIT)
    machine = _machine()
    # Positions cached per request at the middle timed step.
    mid = [FLAGS.prompt + 10 * i + FLAGS.warmup + FLAGS.steps // 2 for i in range(b)]
    roof = roofline.decode_step_cost(cfg, b, mid)
    roof_s = roof.time_s(machine)
    result = {"config": cfg.name, "batch": b, "steps": FLAGS.steps,
              "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
              "roofline_machine": machine.as_dict(), "roofline": roof.as_dict(machine)}
    lines = []
    for p, eng in engines.items():
        t = eng.metrics.snapshot()["total"]
        med = float(np.median(eng.step_seconds))
        result[p] = {"median_step_ms": 1e3 * med,
                     "median_fetch_wait_ms": 1e3 * float(np.median(waits[p])),
                     "roofline_ms": 1e3 * roof_s, "roofline_fraction": roof_s / med,
                     "hits": t["hits"], "misses": t["misses"], "hit_rate": t["hit_rate"]}
        lines.append(f"{p:12s} batch {b}: step {result[p]['median_step_ms']:7.2f} ms (median)"
                     f"  roofline {1e3 * roof_s:6.3f} ms ({roof_s / med:.3f} of it)  "
                     f"fetch wait {result[p]['median_fetch_wait_ms']:6.2f} ms  "
                     f"hits {t['hits']} misses {t['misses']}")
    result["host_driven_over_in_jit"] = (result["host_driven"]["median_step_ms"]
                                         / result["in_jit"]["median_step_ms"])
    lines.append(f"host_driven / in_jit step time: {result['host_driven_over_in_jit']:.2f}")
    if result["in_jit"]["hits"] != result["host_driven"]["hits"]:
        cli.fail(PROG, "the two fetch paths disagree on hits", cli.FAILURE_EXIT)
    path = out / "bench_fetch_path.json"
    lines.append(f"roofline: {machine.name}; JSON {path}")
    cli.write_report(path, result, "\n".join(lines), FLAGS.json)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
