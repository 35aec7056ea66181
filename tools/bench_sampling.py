"""What penalties and constrained decoding cost a decode step.

One engine, one batch of --batch requests decoding --new_tokens tokens each, four ways:
  free         no penalties, no constraint (the baseline);
  penalties    every row with presence, frequency and repetition penalties and a bias;
  half_penalties  the first half of the rows so, the rest free;
  constrained  every row under a JSON-object grammar (llguidance, over the byte-level
               tokenizer, the mask padded to the model's vocabulary);
  mixed        the first half of the rows penalised, the second constrained, and (with
               --batch >= 4) one row free.
Per way: the median decode step (`Engine.step_seconds`), its host share (the step minus
its device wait: the masks are computed there) and the ratio to "free". The floor beside
them: the extra bytes a penalised step touches (per row the counts int32 [V], the prompt
mask [V], the logits read and written: 13 V bytes) divided by the memory bandwidth this
machine measures (a large array copy), and the mask bytes a constrained step uploads
(V / 8 per row).

  python tools/bench_sampling.py --vocab 129280 --batch 4

Results: --out (default out/) bench_sampling.json and bench_sampling.png; the table on
stdout.
"""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parents[1]
KINDS = ("free", "penalties", "half_penalties", "constrained", "mixed")


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/tiny.py", "model/engine config")
    flags.DEFINE_integer("vocab", 129280, "model.vocab_size (DeepSeek-V3.2's by default)")
    flags.DEFINE_integer("batch", 4, "requests decoding together")
    flags.DEFINE_integer("prompt_len", 48, "prompt tokens per request")
    flags.DEFINE_integer("new_tokens", 40, "tokens each request decodes")
    flags.DEFINE_integer("seed", 0, "model and prompt seed")
    flags.DEFINE_string("out", None, "output directory (default: out/ in the repository)")


def _bandwidth() -> float:
    """Bytes/s of a 256 MiB device copy (read + write), best of 3."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((64 * 2 ** 20,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    best = min(_timed(lambda: copy(x).block_until_ready()) for _ in range(3))
    return 2 * x.nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _way(kind: str, i: int, b: int) -> str:
    """What row i of b gets in `kind`."""
    if kind == "half_penalties":
        return "penalties" if i < b // 2 else "free"
    if kind != "mixed":
        return kind
    if i < b // 2:
        return "penalties"
    return "free" if b >= 4 and i == b - 1 else "constrained"


def _run(eng, prompts, kind, grammars) -> dict:
    from jlco.sampling.params import SamplingParams
    from jlco.sampling.penalties import Penalties
    from jlco.structured.grammar import GrammarSpec
    rules = Penalties(presence=0.5, frequency=0.3, repetition=1.2, logit_bias=((5, 1.0),))
    for i, p in enumerate(prompts):
        way = _way(kind, i, len(prompts))
        eng.submit(p, FLAGS.new_tokens, SamplingParams(
            temperature=1.0, seed=i, penalties=rules if way == "penalties" else None,
            constraint=grammars.constraint(GrammarSpec("json_object"))
            if way == "constrained" else None))
    eng.step_seconds.clear()
    eng.host_seconds.clear()
    eng.run()
    steps = eng.step_seconds[2:] or eng.step_seconds
    host = eng.host_seconds[2:] or eng.host_seconds
    return {"step_ms": 1e3 * float(np.median(steps)), "host_ms": 1e3 * float(np.median(host)),
            "steps": len(steps)}


def main(argv) -> int:
    del argv
    from flax import nnx
    from jlco.config import load_config
    from jlco.engine.core import Engine
    from jlco.model.decoder import DeepseekV32
    from jlco.server.text import TextCodec
    from jlco.structured.grammar import Grammars
    from jlco.util import atomic

    out = pathlib.Path(FLAGS.out or REPO / "out")
    atomic.check_writable(out / "bench_sampling.json", "--out")
    cfg = load_config(FLAGS.config).replace(model__vocab_size=FLAGS.vocab,
                                            engine__max_batch_size=FLAGS.batch,
                                            engine__num_draft_tokens=0)
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(FLAGS.seed))
    codec = TextCodec.byte_level(FLAGS.vocab)
    grammars = Grammars(codec.tokenizer, FLAGS.vocab, codec.eos_token_id)
    rng = np.random.default_rng(FLAGS.seed)
    prompts = [list(map(int, rng.integers(0, 256, FLAGS.prompt_len)))
               for _ in range(FLAGS.batch)]
    eng = Engine(cfg, model)
    _run(eng, prompts, "free", grammars)            # compile every shape once
    rows = {k: _run(eng, prompts, k, grammars) for k in KINDS}
    bw = _bandwidth()
    v, b = FLAGS.vocab, FLAGS.batch
    floor_ms = 1e3 * 13 * v * b / bw
    for k in KINDS:
        rows[k]["ratio_to_free"] = rows[k]["step_ms"] / rows["free"]["step_ms"]
        rows[k]["added_ms"] = rows[k]["step_ms"] - rows["free"]["step_ms"]
    report = {"config": FLAGS.config, "vocab": v, "batch": b, "new_tokens": FLAGS.new_tokens,
              "bandwidth_gb_s": bw / 1e9, "penalty_floor_ms": floor_ms,
              "mask_upload_bytes_per_step": b * v // 8, "kinds": rows}
    atomic.write_text(out / "bench_sampling.json", json.dumps(report, indent=1))
    print(f"vocab {v}, batch {b}; measured bandwidth {bw / 1e9:.1f} GB/s; penalty floor "
          f"(13 V bytes per row) {floor_ms:.3f} ms")
    print(f"{'kind':<12} {'step ms':>8} {'host ms':>8} {'x free':>7} {'added ms':>9}")
    for k in KINDS:
        r = rows[k]
        print(f"{k:<12} {r['step_ms']:8.2f} {r['host_ms']:8.2f} {r['ratio_to_free']:7.2f} "
              f"{r['added_ms']:9.2f}")
    _plot(rows, out / "bench_sampling.png", v, b)
    return 0


def _plot(rows, path, v, b) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(KINDS, [rows[k]["step_ms"] for k in KINDS], label="step")
    ax.bar(KINDS, [rows[k]["host_ms"] for k in KINDS], label="host share")
    ax.set_ylabel("median decode step (ms)")
    ax.set_title(f"penalties and constraints, vocab {v}, batch {b}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    define_flags()
    app.run(main)
