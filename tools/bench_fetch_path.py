"""Warm decode step time of the two miss-fetch paths (cache.fetch_path in_jit vs
host_driven) on the same workload, steps interleaved so machine noise hits both alike.
Also checks that both paths produced the same tokens and the same hits.

  python tools/bench_fetch_path.py --config=configs/tiny.py --batch=2 --out=/tmp/fetch.json
"""

from __future__ import annotations

import json

import numpy as np
from absl import app, flags
from flax import nnx

from jlco.config import load_config
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Flags are defined only when this module runs as a program (as the other tools)."""
    flags.DEFINE_string("config", "configs/tiny.py", "model/cache config to start from")
    flags.DEFINE_integer("batch", 2, "requests decoded together")
    flags.DEFINE_integer("prompt", 150, "prompt tokens of the first request (+10 per request)")
    flags.DEFINE_integer("steps", 40, "timed decode steps (median reported)")
    flags.DEFINE_integer("warmup", 12, "untimed steps first (compiles, hot-buffer fill)")
    flags.DEFINE_enum("impl", "xla", ["xla", "auto", "pallas", "interpret"],
                      "attention/indexer impl")
    flags.DEFINE_string("out", "", "JSON output path ('' = none)")


PATHS = ("in_jit", "host_driven")


def main(_):
    b = FLAGS.batch
    new = FLAGS.warmup + FLAGS.steps + 2
    longest = FLAGS.prompt + 10 * (b - 1) + new
    cfg = load_config(FLAGS.config).replace(
        engine__attention_impl=FLAGS.impl, engine__max_batch_size=b,
        engine__max_context_len=longest, cache__offload=True)
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, cfg.model.vocab_size, FLAGS.prompt + 10 * i)))
               for i in range(b)]
    engines = {p: Engine(cfg.replace(cache__fetch_path=p), model) for p in PATHS}
    for eng in engines.values():
        for p in prompts:
            eng.submit(p, new)
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
    tokens = {p: [r.tokens for r in e.requests.values()] for p, e in engines.items()}
    if tokens["in_jit"] != tokens["host_driven"]:
        raise SystemExit("the two fetch paths produced different tokens")
    result = {"config": cfg.name, "batch": b, "steps": FLAGS.steps}
    for p, eng in engines.items():
        t = eng.metrics.snapshot()["total"]
        result[p] = {"median_step_ms": 1e3 * float(np.median(eng.step_seconds)),
                     "median_fetch_wait_ms": 1e3 * float(np.median(waits[p])),
                     "hits": t["hits"], "misses": t["misses"], "hit_rate": t["hit_rate"]}
        print(f"{p:12s} batch {b}: step {result[p]['median_step_ms']:7.2f} ms (median)  "
              f"fetch wait {result[p]['median_fetch_wait_ms']:6.2f} ms  "
              f"hits {t['hits']} misses {t['misses']}")
    if result["in_jit"]["hits"] != result["host_driven"]["hits"]:
        raise SystemExit("the two fetch paths disagree on hits")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
