"""jlco against the engine a CPU user would otherwise run, `transformers`' eager
DeepseekV32ForCausalLM, on the same random weights and prompts, with the roofline beside.

One transformers model is built from `--config` (random fp32 weights, saved with
`save_pretrained` and loaded into jlco through its own checkpoint loader, so both run the
same numbers). `--batch` N requests of `--prompt_len` random tokens each. Measured, after
a warm-up of each:
  prefill   the N prompts (transformers: one batched forward [N, prompt_len] filling its
            cache, as its user would send N equal-length requests; jlco: the engine's
            admission, `Engine.admit`, as `python -m jlco.generate --prompts_file` runs
            it: every prompt's chunked prefill, `engine.prefill_chunk` positions a piece,
            to its first token);
  decode    `--steps` greedy steps at batch N from those prompts (transformers: forward
            with past_key_values; jlco: engine steps).
Ratios: jlco / transformers speed, and each side against the roofline
(`jlco.planning.roofline`: bytes a step must touch ÷ memory bandwidth, FLOPs ÷ peak; the
prefill's is `decode_step_cost` with s_q = prompt_len query tokens per request over an empty
cache, the FLOPs bound). The greedy tokens of both are compared per prompt, the first
token (the prefill's) on its own (equal up to float ties on a random model).

transformers' batched prefill grows much faster than N: its indexer's
`torch.matmul(q [N, s, H, D], k^T [N, 1, D, t])` can broadcast k over the s queries as a
view only for N = 1; for N > 1 torch copies it to [N, s, D, t] (8 GiB of f32 per layer
at 4 x 2048) and then reads it in a batched matmul of N·s tiny products.
Writes vs_transformers.json and vs_transformers.png (prefill and decode bars) to --out.

  python tools/bench_vs_transformers.py --batch=4 --prompt_len=2048 --steps=8 --out=out/vs_hf
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import platform
import tempfile
import time

import numpy as np
from absl import flags

from jlco.planning import roofline
from jlco.util import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_vs_transformers"
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/bench_mid.py", "model config (random weights)")
    flags.DEFINE_integer("batch", 1, "requests prefilled and decoded together", lower_bound=1)
    flags.DEFINE_integer("prompt_len", 2048, "prompt tokens per request", lower_bound=1)
    flags.DEFINE_integer("steps", 8, "decode steps timed", lower_bound=1)
    flags.DEFINE_integer("prefill_chunk", 512, "jlco engine.prefill_chunk", lower_bound=1)
    flags.DEFINE_float("mem_gbps", None, "memory bandwidth for the roofline (GB/s; default: "
                       "measured on this machine, jlco.planning.probe)")
    flags.DEFINE_float("peak_gflops", None, "f32 peak for the roofline (GFLOP/s; default: measured "
                       "on this machine, jlco.planning.probe)")
    flags.DEFINE_string("out", "out/vs_transformers", "directory for the JSON and PNG")
    flags.DEFINE_bool("json", False, "print the JSON to stdout (the table to stderr)")


def prompts_for(vocab: int) -> list[list[int]]:
    """--batch random prompts of --prompt_len tokens (seeded: both sides get the same)."""
    rng = np.random.default_rng(0)
    return rng.integers(0, vocab, (FLAGS.batch, FLAGS.prompt_len)).tolist()


def hf_side(model, prompts: list[list[int]]) -> dict:
    import torch
    ids = torch.tensor(prompts)
    with torch.no_grad():
        # Warm-up at batch N: torch's first call of a shape sets up kernels and buffers.
        warm = model(ids[:, :16], use_cache=True)
        model(warm.logits[:, -1:].argmax(-1), past_key_values=warm.past_key_values,
              use_cache=True)
        del warm
        t = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - t
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
        tokens, times = [tok.tolist()], []
        for _ in range(FLAGS.steps):
            t = time.perf_counter()
            out = model(tok[:, None], past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
            tokens.append(tok.tolist())
    per_prompt = [list(t) for t in zip(*tokens)]
    return dict(prefill_s=prefill, step_ms=1e3 * float(np.median(times)), tokens=per_prompt)


def jlco_side(ckpt: str, prompts: list[list[int]]) -> dict:
    from jlco.checkpoint.load import load_model
    from jlco.config import load_config
    from jlco.engine.core import Engine
    base = load_config(ROOT / FLAGS.config)
    mcfg, model, _ = load_model(ckpt, {"dtype": "float32"}, progress=False)
    cfg = base.replace(model=mcfg, engine__max_batch_size=len(prompts),
                       engine__max_context_len=FLAGS.prompt_len + FLAGS.steps + 8,
                       engine__prefill_chunk=FLAGS.prefill_chunk)
    eng = Engine(cfg, model)
    try:
        for warm in (True, False):
            reqs = [eng.submit(p, FLAGS.steps + 1) for p in prompts]
            t = time.perf_counter()
            eng.admit()
            prefill = time.perf_counter() - t
            eng.step_seconds.clear()
            eng.run()
            if not warm:
                return dict(prefill_s=prefill,
                            step_ms=1e3 * float(np.median(eng.step_seconds)),
                            tokens=[list(r.tokens) for r in reqs], config=cfg)
    finally:
        eng.close()


def roofline_s(cfg, machine) -> tuple[float, float]:
    """(prefill, decode step) roofline seconds at --batch: the prefill as one step of
    prompt_len query tokens per request over an empty cache; the step at its end."""
    from jlco.planning import roofline
    b, n = FLAGS.batch, FLAGS.prompt_len
    return (roofline.decode_step_cost(cfg, b, 0, s_q=n).time_s(machine),
            roofline.decode_step_cost(cfg, b, n).time_s(machine))


def compare(ours: dict, peer: dict, cfg) -> dict:
    from jlco.planning import roofline
    machine = roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    pre_roof, step_roof = roofline_s(cfg, machine)
    first = [a[0] == b[0] for a, b in zip(ours["tokens"], peer["tokens"])]
    return dict(
        batch=FLAGS.batch, prompt_len=FLAGS.prompt_len, steps=FLAGS.steps,
        jlco=ours, transformers=peer,
        prefill_speedup=peer["prefill_s"] / ours["prefill_s"],
        decode_speedup=peer["step_ms"] / ours["step_ms"],
        roofline_prefill_s=pre_roof, roofline_step_ms=1e3 * step_roof,
        jlco_prefill_over_roofline=ours["prefill_s"] / pre_roof,
        transformers_prefill_over_roofline=peer["prefill_s"] / pre_roof,
        jlco_step_over_roofline=ours["step_ms"] / (1e3 * step_roof),
        transformers_step_over_roofline=peer["step_ms"] / (1e3 * step_roof),
        same_first_tokens=first, same_tokens=ours["tokens"] == peer["tokens"],
        machine=dict(mem_gbps=machine.mem_bw / 1e9, peak_gflops=machine.peak_flops / 1e9,
                     source=machine.source, cpus=os.cpu_count(),
                     platform=platform.platform()))


def table(out: dict) -> str:
    lines = [f"batch {out['batch']} x {out['prompt_len']} prompt tokens, {out['steps']} decode "
             "steps",
             f"{'':14}{'prefill s':>10}{'x roofline':>11}{'step ms':>10}{'x roofline':>11}"]
    for name in ("jlco", "transformers"):
        side = out[name]
        lines.append(f"{name:14}{side['prefill_s']:>10.2f}"
                     f"{out[name + '_prefill_over_roofline']:>10.1f}x{side['step_ms']:>10.1f}"
                     f"{out[name + '_step_over_roofline']:>10.1f}x")
    lines.append(f"{'roofline':14}{out['roofline_prefill_s']:>10.3f}{'':>11}"
                 f"{out['roofline_step_ms']:>10.2f}")
    lines.append(f"jlco speed-up: prefill {out['prefill_speedup']:.2f}x, decode step "
                 f"{out['decode_speedup']:.2f}x; same first tokens: {out['same_first_tokens']}; "
                 f"same greedy tokens: {out['same_tokens']}")
    return "\n".join(lines)


def plot(out: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    names = ["jlco", "transformers", "roofline"]
    pre = [out["jlco"]["prefill_s"], out["transformers"]["prefill_s"], out["roofline_prefill_s"]]
    step = [out["jlco"]["step_ms"], out["transformers"]["step_ms"], out["roofline_step_ms"]]
    for ax, vals, label in ((axes[0], pre, f"prefill {out['batch']} x {out['prompt_len']}, s"),
                            (axes[1], step, f"decode step, batch {out['batch']}, ms")):
        ax.bar(names, vals, color=["C0", "C1", "C7"])
        for x, v in zip(names, vals):
            ax.text(x, v, f"{v:.4g}", ha="center", va="bottom")
        ax.set_ylabel(label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _hf_reference():
    """tests/support/hf_reference.py, loaded from its file: the transformers reference
    model lives with the tests, which are no installed package."""
    path = ROOT / "tests" / "support" / "hf_reference.py"
    spec = importlib.util.spec_from_file_location("hf_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv) -> None:
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    from jlco.config import load_config
    base = load_config(ROOT / FLAGS.config)
    prompts = prompts_for(base.model.vocab_size)
    hf_model = _hf_reference().build_hf_model(base.model)
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        ours = jlco_side(d, prompts)
    peer = hf_side(hf_model, prompts)
    out = compare(ours, peer, ours.pop("config"))
    dest = pathlib.Path(FLAGS.out)
    dest.mkdir(parents=True, exist_ok=True)
    plot(out, dest / "vs_transformers.png")
    cli.write_report(dest / "vs_transformers.json", out,
                     table(out) + f"\nwrote {dest / 'vs_transformers.json'}", FLAGS.json)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
