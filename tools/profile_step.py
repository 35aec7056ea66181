"""Where a decode step and a prefill spend their time, per op family, from a jax.profiler
trace of the real engine.

A random-weight model is built from `--config` (default configs/bench_mid.py: hidden 512,
4 layers, 8 MLA heads, kv_lora_rank 512, 16 routed experts, 16 index heads of 128,
top-k 256, float32).
Decode: `--batch` requests with synthetic contexts (`jlco.engine.synthetic`) of each
`--contexts` length; prefill: one prompt of `--prefill_len` tokens, timed after a warm-up
prompt of the same length. Op time is the XLA:CPU thunk time summed per family
(indexer, sparse_mla, moe, other mla, rest), from the op names in the compiled HLO.

  python tools/profile_step.py --contexts=2048,8192 --prefill_len=2048 --out=out/profile
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from jlco.config import load_config
from jlco.engine import synthetic
from jlco.engine.core import Engine
from jlco.model.decoder import DeepseekV32

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS
# Offload's own work first (it runs inside the mla scope): the miss fetch, the hot-buffer
# lookup around it, and writing new rows to the host pool and hot buffer.
FAMILIES = ("offload_fetch_in_jit", "offload_latent_for_attention", "offload_write_latent",
            "indexer", "sparse_mla", "moe", "/mla/")


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/bench_mid.py", "config to start from")
    flags.DEFINE_list("contexts", ["2048", "8192"], "decode contexts (tokens per request)")
    flags.DEFINE_integer("batch", 4, "decode batch", lower_bound=1)
    flags.DEFINE_integer("steps", 6, "timed decode steps per context", lower_bound=1)
    flags.DEFINE_integer("prefill_len", 2048, "prompt tokens to prefill (0 = skip)",
                         lower_bound=0)
    flags.DEFINE_integer("prefill_chunk", 512, "engine.prefill_chunk", lower_bound=1)
    flags.DEFINE_bool("offload", False, "latent cache in host memory")
    flags.DEFINE_enum("impl", "auto", ["auto", "xla", "interpret"], "attention/indexer impl")
    flags.DEFINE_enum("cpu_matmul", "auto", ["auto", "native", "xla"],
                      "engine.cpu_matmul: decode-sized matmuls on jlco's kernel or XLA's dot")
    flags.DEFINE_string("out", "out/profile", "directory for profile.json and traces")
    flags.DEFINE_bool("json", False, "print the JSON to stdout instead of the table")


def make_config(context: int, batch: int):
    cfg = load_config(ROOT / FLAGS.config if not os.path.exists(FLAGS.config) else FLAGS.config)
    return cfg.replace(engine__max_batch_size=batch, engine__max_context_len=context + 64,
                       engine__prefill_chunk=FLAGS.prefill_chunk,
                       engine__attention_impl=FLAGS.impl, cache__offload=FLAGS.offload,
                       engine__cpu_matmul=FLAGS.cpu_matmul,
                       cache__page_size=64)


def op_families(trace_dir: str, hlo: str, repeats: int) -> dict[str, float]:
    """ms per repeat of each op family, from the trace's XLA thunk events."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            per_op[e["name"]] += e.get("dur", 0)
    fams = collections.Counter()
    for name, us in per_op.items():
        m = re.search(r"^\s*%?" + re.escape(name) + r" = (.*)$", hlo, re.M)
        if not m:
            continue   # runtime events (executor, transfers), not HLO ops
        text = m.group(1)
        call = re.search(r"calls=%([\w.\-]+)", text)
        if call:   # a fusion's op names live in its computation
            text += hlo.split("%" + call.group(1) + " ", 1)[-1][:4000]
        names = " ".join(re.findall(r'op_name="([^"]*)', text))
        fam = next((f.strip("/") for f in FAMILIES if f in names), "rest")
        fams[fam] += us / 1e3 / repeats
    return dict(fams)


def profile_decode(model, context: int) -> dict:
    cfg = make_config(context, FLAGS.batch)
    eng = Engine(cfg, model)
    for b in range(FLAGS.batch):
        c = synthetic.synthetic_cache(cfg, jax.random.PRNGKey(b), n=context,
                                      max_len=cfg.engine.max_context_len)
        synthetic.admit_prefilled(eng, c, FLAGS.steps + 8, first_token=b)
    eng.step()   # compile
    eng.step_seconds.clear()
    for _ in range(FLAGS.steps):
        eng.step()
    run = eng.runner
    # The step lowered as the engine runs it (every slot active, its scan bucket).
    lowered = run.stepper.lower(run.cache, [])
    trace_dir = os.path.join(FLAGS.out, f"trace_decode_{context}")
    shutil.rmtree(trace_dir, ignore_errors=True)
    eng.drain()   # async scheduling: the trace holds exactly the two steps queued in it
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        eng.step()
        eng.step()
        eng.drain()
    fams = {}
    if lowered is not None and run.spec is None:
        hlo = lowered.compile().as_text()
        # Beside the trace: the thunk names in it (fusions, custom calls) are this text's.
        pathlib.Path(trace_dir, "decode_step.hlo.txt").write_text(hlo)
        fams = op_families(trace_dir, hlo, 2)
    return dict(context=context, batch=FLAGS.batch,
                step_ms=1e3 * float(np.median(eng.step_seconds[:FLAGS.steps])),
                op_ms=fams)


def profile_prefill(model) -> dict:
    n = FLAGS.prefill_len
    cfg = make_config(n, 1)
    eng = Engine(cfg, model)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(2):   # the first includes compiles
        req = eng.submit(rng.integers(0, cfg.model.vocab_size, n).tolist(), 1)
        t = time.perf_counter()
        eng.admit()
        times.append(time.perf_counter() - t)
        assert req.done
    return dict(prompt_tokens=n, chunk=FLAGS.prefill_chunk, first_s=times[0], warm_s=times[1],
                tokens_per_s=n / times[1])


def main(argv) -> None:
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    base = make_config(1024, 1)
    model = DeepseekV32(base.model, rngs=nnx.Rngs(0))
    out = dict(machine=dict(cpus=os.cpu_count(), jax=jax.__version__,
                            backend=jax.default_backend()),
               impl=FLAGS.impl, offload=FLAGS.offload,
               decode=[profile_decode(model, int(c)) for c in FLAGS.contexts])
    if FLAGS.prefill_len:
        out["prefill"] = profile_prefill(model)
    path = os.path.join(FLAGS.out, "profile.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)
    if FLAGS.json:
        print(json.dumps(out, indent=1))
        return
    for d in out["decode"]:
        fams = ", ".join(f"{k} {v:.1f}" for k, v in sorted(d["op_ms"].items(), key=lambda x: -x[1]))
        print(f"decode ctx {d['context']:>6} batch {d['batch']}: step {d['step_ms']:.1f} ms "
              f"(op ms summed over threads: {fams})")
    if "prefill" in out:
        p = out["prefill"]
        print(f"prefill {p['prompt_tokens']} tokens (chunk {p['chunk']}): {p['warm_s']:.2f} s "
              f"warm ({p['tokens_per_s']:.0f} tok/s), first {p['first_s']:.2f} s with compiles")
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
