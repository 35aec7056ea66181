"""jlco against the engine a CPU user would otherwise run, `transformers`' eager
DeepseekV32ForCausalLM, on the same random weights and prompt, with the roofline beside.

One transformers model is built from `--config` (random fp32 weights, saved with
`save_pretrained` and loaded into jlco through its own checkpoint loader, so both run the
same numbers). Measured, after a warm-up of each:
  prefill   one prompt of `--prompt_len` tokens (transformers: one forward filling its
            cache; jlco: the engine's chunked prefill, `engine.prefill_chunk`);
  decode    `--steps` greedy steps at batch 1 from that prompt (transformers: forward
            with past_key_values; jlco: engine steps).
Ratios: jlco / transformers speed, and each side's step against the roofline
(`jlco.planning.roofline`: bytes a step must touch ÷ memory bandwidth, FLOPs ÷ peak).
The greedy tokens of both are compared (equal up to float ties on a random model).

  python tools/bench_vs_transformers.py --prompt_len=2048 --steps=8 --out=out/vs_hf
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/bench_mid.py", "model config (random weights)")
    flags.DEFINE_integer("prompt_len", 2048, "prompt tokens", lower_bound=1)
    flags.DEFINE_integer("steps", 8, "decode steps timed", lower_bound=1)
    flags.DEFINE_integer("prefill_chunk", 512, "jlco engine.prefill_chunk", lower_bound=1)
    flags.DEFINE_float("mem_gbps", 14.9, "memory bandwidth for the roofline (GB/s)")
    flags.DEFINE_float("peak_gflops", 130.0, "f32 peak for the roofline (GFLOP/s)")
    flags.DEFINE_string("out", "out/vs_transformers", "directory for the JSON")
    flags.DEFINE_bool("json", False, "print the JSON to stdout instead of the table")


def hf_side(model, prompt: list[int]) -> dict:
    import torch
    ids = torch.tensor([prompt])
    with torch.no_grad():
        model(ids[:, :16], use_cache=True)   # warm-up
        t = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens, times = [tok], []
        for _ in range(FLAGS.steps):
            t = time.perf_counter()
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t)
            past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
            tokens.append(tok)
    return dict(prefill_s=prefill, step_ms=1e3 * float(np.median(times)), tokens=tokens)


def jlco_side(ckpt: str, prompt: list[int]) -> dict:
    from jlco.checkpoint.load import load_model
    from jlco.config import load_config
    from jlco.engine.core import Engine
    base = load_config(ROOT / FLAGS.config)
    mcfg, model, _ = load_model(ckpt, {"dtype": "float32"}, progress=False)
    n = len(prompt)
    cfg = base.replace(model=mcfg, engine__max_batch_size=1,
                       engine__max_context_len=n + FLAGS.steps + 8,
                       engine__prefill_chunk=FLAGS.prefill_chunk)
    eng = Engine(cfg, model)
    for warm in (True, False):
        req = eng.submit(prompt, FLAGS.steps + 1)
        t = time.perf_counter()
        eng.admit()
        prefill = time.perf_counter() - t
        eng.step_seconds.clear()
        eng.run()
        if not warm:
            return dict(prefill_s=prefill, step_ms=1e3 * float(np.median(eng.step_seconds)),
                        tokens=list(req.tokens), config=cfg)


def main(argv) -> None:
    del argv
    from hf_reference import build_hf_model

    from jlco.config import load_config
    from jlco.planning import roofline
    base = load_config(ROOT / FLAGS.config)
    prompt = np.random.default_rng(0).integers(0, base.model.vocab_size,
                                               FLAGS.prompt_len).tolist()
    hf_model = build_hf_model(base.model)
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        ours = jlco_side(d, prompt)
    peer = hf_side(hf_model, prompt)
    machine = roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    step_roof = roofline.decode_step(ours.pop("config"), 1, [FLAGS.prompt_len]).time_s(machine)
    out = dict(prompt_len=FLAGS.prompt_len, steps=FLAGS.steps, jlco=ours, transformers=peer,
               prefill_speedup=peer["prefill_s"] / ours["prefill_s"],
               decode_speedup=peer["step_ms"] / ours["step_ms"],
               roofline_step_ms=1e3 * step_roof,
               jlco_step_roofline_fraction=1e3 * step_roof / ours["step_ms"],
               transformers_step_roofline_fraction=1e3 * step_roof / peer["step_ms"],
               same_tokens=ours["tokens"] == peer["tokens"],
               machine=dict(mem_gbps=FLAGS.mem_gbps, peak_gflops=FLAGS.peak_gflops,
                            cpus=os.cpu_count()))
    os.makedirs(FLAGS.out, exist_ok=True)
    path = os.path.join(FLAGS.out, "vs_transformers.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)
    if FLAGS.json:
        print(json.dumps(out, indent=1))
        return
    print(f"prompt {FLAGS.prompt_len} tokens, batch 1, {FLAGS.steps} decode steps")
    print(f"{'':14}{'prefill s':>10}{'step ms':>10}{'step/roofline':>15}")
    for name, side, frac in (("jlco", ours, out["jlco_step_roofline_fraction"]),
                             ("transformers", peer, out["transformers_step_roofline_fraction"])):
        print(f"{name:14}{side['prefill_s']:>10.2f}{side['step_ms']:>10.1f}{1 / frac:>14.1f}x")
    print(f"jlco speed-up: prefill {out['prefill_speedup']:.2f}x, decode step "
          f"{out['decode_speedup']:.2f}x; roofline step {out['roofline_step_ms']:.2f} ms; "
          f"same greedy tokens: {out['same_tokens']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
