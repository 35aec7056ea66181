"""Prefill benchmark: tokens/s, time per token and peak RSS of one long prompt's prefill
per length, each beside its roofline.

Each length runs in a fresh child process (this program with --child_length), so its
peak RSS is that child's own VmHWM (/proc/self/status, read at its end: model, engine
and the prefill together; `base_rss_gib` is the RSS before the prefill). The child builds
the model and engine exactly as `python -m jlco.generate --config CONFIG` does
(`jlco.launch.load`; no --checkpoint: the random-weight model, configs/tiny.py's shape
for a config whose own model is too big to build; no MTP drafts), submits one prompt of
random token ids with max_new_tokens 1 and times admission to the first token (the
chunked prefill, the install into its slot, with offload the hot-buffer warm-up, and the
first token's sampling): that is `prefill_s`, the time to first token.

Compilation is kept out of `prefill_s`: a length up to --rerun_max is prefilled twice
(fresh prompts of the same length, so the same shapes) and the second run is reported;
a longer one is run once and the compile time JAX logs for it (trace, lowering and
backend compile events, `jax.monitoring`) is subtracted. Every prefill piece is waited
for before the next is dispatched (so no compile overlaps a running piece and the
subtraction holds; `piece_s`: each piece's seconds, beside `piece_roofline_s`). All
figures are in the JSON (`first_s`, `compile_s`, `first_less_compile_s`, `warm_s`).

Roofline (`jlco.planning.roofline.prefill_cost`): the bytes the prefill must touch and
the FLOPs it must do, piece by piece as the engine runs it (the indexer's FLOPs and key
reads grow with position, everything else is per token), divided by the machine's
limits: on CPU --mem_gbps / --peak_gflops (default: measured on this machine), on an
accelerator the `jlco.planning.hardware` profile of its device kind (--hardware).
`roofline_s` counts the real tokens (`over_roofline` = prefill_s / roofline_s);
`roofline_as_run_s` what the engine computes (padded pieces, whole scan buckets).

  python tools/bench_prefill.py --lengths=2048,8192                 # CPU, minutes
  python tools/bench_prefill.py                                     # 2K..128K on configs/128k.py

Outputs: --json_out and --png_out (default out/bench_prefill.{json,png}); the table on
stdout (--json: the JSON on stdout, the table on stderr); a line per length on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

from absl import app, flags, logging

from jlco.planning import roofline
from jlco.util import atomic, cli, compile_cache
from jlco.util.compile_clock import CompileClock

REPO = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_prefill"
FLAGS = flags.FLAGS
RESULT_TAG = "BENCH_PREFILL_RESULT "   # the child's one result line on stdout
GIB = 2 ** 30


def define_flags() -> None:
    """Flags exist only when this runs as a program (importing tools side by side must
    not collide)."""
    flags.DEFINE_string("config", "configs/128k.py", "config file (a relative path not found "
                        "from the current directory is looked up in the repository)")
    flags.DEFINE_list("lengths", ["2048", "8192", "32768", "131072"], "prompt lengths (tokens)")
    flags.DEFINE_string("checkpoint", None, "HF or Orbax checkpoint directory (none: the "
                        "random-weight model jlco.generate builds for --config)")
    flags.DEFINE_integer("seed", 0, "random model and prompt seed", lower_bound=0)
    flags.DEFINE_enum("impl", None, ["auto", "xla", "pallas", "interpret"],
                      "attention kernels (default: the config's)")
    flags.DEFINE_integer("rerun_max", 8192, "lengths up to this are prefilled twice and the "
                         "second (compiled) run is timed; longer ones once, less JAX's logged "
                         "compile time", lower_bound=0)
    flags.DEFINE_string("json_out", None, "JSON report (default out/bench_prefill.json)")
    flags.DEFINE_string("png_out", None, "plot (default out/bench_prefill.png)")
    flags.DEFINE_bool("json", False, "print the JSON report on stdout (the table on stderr)")
    flags.DEFINE_string("hardware", "auto", "roofline limits: auto (cpu, or the profile of "
                        "the accelerator's device kind), cpu (--mem_gbps/--peak_gflops), or "
                        "a jlco.planning.hardware key")
    flags.DEFINE_float("mem_gbps", None,
                       "CPU memory bandwidth, GB/s (roofline on cpu; default: "
                       "measured on this machine, jlco.planning.probe)")
    flags.DEFINE_float("peak_gflops", None,
                       "CPU peak GFLOP/s (roofline on cpu; default: measured "
                       "on this machine, jlco.planning.probe)")
    flags.DEFINE_integer("child_length", None, "internal: run one length in this process and "
                         "print its result line", lower_bound=1)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_config(path: str) -> pathlib.Path:
    p = pathlib.Path(path).expanduser()
    if not p.exists() and not p.is_absolute() and (REPO / p).exists():
        p = REPO / p
    if not p.is_file():
        raise ValueError(f"--config={path}: no such file")
    return p


def _lengths() -> list[int]:
    try:
        out = [int(x) for x in FLAGS.lengths]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"--lengths={','.join(FLAGS.lengths)}: allowed comma-separated "
                         "positive integers")
    return out


# ---- the child: one length --------------------------------------------------------------

def _status_kib(field: str) -> int:
    """A /proc/self/status field in KiB (VmHWM: peak RSS, VmRSS: current)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def pick_machine():
    """The roofline's limits (--hardware; auto: the device this process sees)."""
    import jax

    hw = FLAGS.hardware.lower()
    cpu = roofline.cpu_machine(FLAGS.mem_gbps, FLAGS.peak_gflops)
    if hw == "cpu":
        return cpu
    if hw != "auto":
        return roofline.hardware_machine(hw)
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return cpu
    key = roofline.profile_for_device_kind(dev.device_kind)
    if key is None:
        cli.warn(PROG, f"no hardware profile for device kind {dev.device_kind!r}: the "
                 f"roofline uses --mem_gbps / --peak_gflops (pass --hardware=KEY)")
        return cpu
    return roofline.hardware_machine(key)


def build(n: int):
    """(cfg, model, mesh, banner) as `jlco.generate` builds them for a `--config` run of
    one n-token prompt with max_new_tokens 1 (its `engine_shape`, no drafts)."""
    from jlco.config import load_config
    from jlco.generate import engine_shape
    from jlco.launch import load
    base = load_config(resolve_config(FLAGS.config))
    choice = load.choose_model(FLAGS.checkpoint, base, None, FLAGS.seed)
    name = (FLAGS.checkpoint and pathlib.Path(FLAGS.checkpoint).name) or base.name
    shape = engine_shape(choice.model, base.engine, [n], 1, True, choice.own_model)
    over = dict(shape, cache__offload=base.cache.offload, engine__num_draft_tokens=0,
                **({"engine__attention_impl": FLAGS.impl} if FLAGS.impl else {}))
    checked = base.replace(model=choice.model, name=name, **over)
    mesh = load.checked_mesh(checked)
    cfg, model = load.load_sharded(choice, checked, mesh, seed=FLAGS.seed, verify=True)
    return cfg, model, mesh, choice.banner


class PieceTimer:
    """Watches the runner's prefill pieces (`ModelRunner.piece_observers`): each piece is
    waited for (no compile of the next piece overlaps this one's execution, so
    subtracting the compile time logged is exact) and timed from its start: (wall
    seconds, compile seconds) per piece."""

    def __init__(self, runner, clock: CompileClock):
        self.clock, self.times = clock, []
        self._c0 = clock.total
        runner.piece_observers.append(self)

    def reset(self) -> None:
        """Forget the pieces timed so far; compile time counts from now."""
        self.times, self._c0 = [], self.clock.total

    def __call__(self, job, t0: float) -> None:
        import jax
        jax.block_until_ready(job.hidden)
        self.times.append((time.perf_counter() - t0, self.clock.total - self._c0))
        self._c0 = self.clock.total


def time_prefill(engine, prompt: list[int], clock: CompileClock, pieces: PieceTimer) -> dict:
    """One request of max_new_tokens 1 (admission prefills it and samples its token):
    seconds from submit to the first token, the compile seconds logged meanwhile, and
    each piece's seconds less its compile."""
    c0, t0 = clock.total, time.perf_counter()
    pieces.reset()
    req = engine.submit(prompt, 1)
    engine.admit()
    dt = time.perf_counter() - t0
    if not (req.done and len(req.tokens) == 1):
        raise RuntimeError(f"the request did not finish at its first token ({req.status})")
    engine.run()
    return dict(s=dt, compile_s=clock.total - c0, piece_s=[w - c for w, c in pieces.times])


def measure(engine, n: int, vocab: int) -> dict:
    """One length's timings: a first run (its logged compile time subtracted), and up to
    --rerun_max a second on a fresh prompt of the same length (compiled shapes), which
    is then the figure reported."""
    import numpy as np
    rng = np.random.default_rng(FLAGS.seed)
    clock = CompileClock()
    timer = PieceTimer(engine.runner, clock)
    first = time_prefill(engine, rng.integers(0, vocab, n).tolist(), clock, timer)
    out = dict(first_s=first["s"], compile_s=first["compile_s"],
               first_less_compile_s=max(first["s"] - first["compile_s"], 1e-9),
               warm_s=None, warm_compile_s=None)
    if n <= FLAGS.rerun_max:
        warm = time_prefill(engine, rng.integers(0, vocab, n).tolist(), clock, timer)
        out.update(warm_s=warm["s"], warm_compile_s=warm["compile_s"], prefill_s=warm["s"],
                   piece_s=warm["piece_s"], method="second run")
    else:
        out.update(prefill_s=out["first_less_compile_s"], piece_s=first["piece_s"],
                   method="first run less logged compile time")
    return out


def child(n: int) -> dict:
    """Build, prefill, measure one length; the result row (roofline included)."""
    import jax

    from jlco.engine.core import Engine
    from jlco.planning import roofline
    t0 = time.perf_counter()
    cfg, model, mesh, banner = build(n)
    _say(f"[{n}] {banner}")
    machine = pick_machine()
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        engine = Engine(cfg, model, impl=FLAGS.impl)
        try:
            base_rss = _status_kib("VmRSS") * 1024
            _say(f"[{n}] engine built in {time.perf_counter() - t0:.1f} s "
                 f"(RSS {base_rss / GIB:.2f} GiB); prefilling")
            row = measure(engine, n, cfg.model.vocab_size)
        finally:
            engine.close()
    roof = roofline.prefill_cost(cfg, n)
    r = roof.as_dict(machine)
    t = row["prefill_s"]
    row.update(length=n, tokens_per_s=n / t, s_per_token=t / n,
               peak_rss_gib=_status_kib("VmHWM") * 1024 / GIB, base_rss_gib=base_rss / GIB,
               roofline_s=r["useful"]["time_s"], roofline_as_run_s=r["as_run"]["time_s"],
               over_roofline=t / r["useful"]["time_s"],
               over_roofline_as_run=t / r["as_run"]["time_s"],
               piece_roofline_s=[p.time_s(machine) for p in roof.useful],
               bound=r["useful"]["bound"], bytes=r["useful"]["total_bytes"],
               flops=r["useful"]["total_flops"], as_run_bytes=r["as_run"]["total_bytes"],
               as_run_flops=r["as_run"]["total_flops"], roofline=r,
               roofline_machine=machine.as_dict(), device=_device(),
               model=_model_desc(cfg), context=cfg.engine.max_context_len,
               chunk=cfg.engine.prefill_chunk, offload=cfg.cache.offload)
    return row


def _device() -> str:
    import jax
    dev = jax.devices()[0]
    return (f"{platform.machine()} {os.cpu_count()} cores, {dev.platform}"
            f"{'' if dev.platform == 'cpu' else ' ' + dev.device_kind}, jax {jax.__version__}")


def _model_desc(cfg) -> str:
    m = cfg.model
    return (f"{m.num_hidden_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads, index {m.index_n_heads}x{m.index_head_dim}, topk {m.index_topk}, "
            f"{m.dtype}, {cfg.cache.kv_format} rows, {cfg.cache.indexer_key_format} keys")


# ---- the parent: one child per length ----------------------------------------------------

def _child_args(n: int) -> list[str]:
    names = ("config", "checkpoint", "seed", "impl", "rerun_max", "hardware", "mem_gbps",
             "peak_gflops")
    args = [f"--{k}={FLAGS[k].value}" for k in names if FLAGS[k].value is not None]
    return [sys.executable, str(pathlib.Path(__file__).resolve()), *args, f"--child_length={n}"]


def run_length(n: int) -> dict:
    """One length in a fresh process → its row, or {length, error} if the child failed
    (an out-of-memory kill included)."""
    t0 = time.perf_counter()
    p = subprocess.run(_child_args(n), stdout=subprocess.PIPE, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    lines = [x for x in p.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if p.returncode != 0 or not lines:
        why = (f"killed by signal {-p.returncode} (out of memory?)" if p.returncode < 0
               else f"exit {p.returncode}")
        _say(f"[{n}] FAILED: {why} after {wall:.0f} s")
        return dict(length=n, error=why, child_wall_s=wall)
    row = json.loads(lines[-1][len(RESULT_TAG):])
    row["child_wall_s"] = wall
    _say(f"[{n}] prefill {row['prefill_s']:.2f} s ({row['tokens_per_s']:.0f} tok/s), "
         f"compile {row['compile_s']:.1f} s, peak RSS {row['peak_rss_gib']:.2f} GiB, "
         f"{row['over_roofline']:.1f}x roofline; child wall {wall:.0f} s")
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'length':>7} {'prefill s':>9} {'tok/s':>8} {'ms/tok':>8} {'compile s':>9} "
            f"{'peak GiB':>8} {'roof s':>8} {'x roof':>7} {'as-run s':>8} {'x as-run':>8} "
            f"{'bound':>7}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['length']:>7} FAILED: {r['error']}")
            continue
        lines.append(
            f"{r['length']:>7} {r['prefill_s']:>9.3f} {r['tokens_per_s']:>8.0f} "
            f"{r['s_per_token'] * 1e3:>8.3f} {r['compile_s']:>9.2f} {r['peak_rss_gib']:>8.2f} "
            f"{r['roofline_s']:>8.4g} {r['over_roofline']:>7.2f} {r['roofline_as_run_s']:>8.4g} "
            f"{r['over_roofline_as_run']:>8.2f} {r['bound']:>7}")
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    """tokens/s against length with the roofline's (useful and as run), and peak RSS."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in report["rows"] if "error" not in r]
    n = [r["length"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(n, [r["tokens_per_s"] for r in ok], "o-", label="measured")
    ax1.plot(n, [r["length"] / r["roofline_s"] for r in ok], "k--", label="roofline")
    ax1.plot(n, [r["length"] / r["roofline_as_run_s"] for r in ok], "k:",
             label="roofline as run (padded)")
    ax1.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill tokens/s",
            title="prefill throughput")
    ax1.legend(fontsize=8)
    ax2.plot(n, [r["peak_rss_gib"] for r in ok], "o-", label="peak RSS (VmHWM)")
    ax2.plot(n, [r["base_rss_gib"] for r in ok], "s:", label="RSS before prefill")
    ax2.set(xscale="log", xlabel="prompt tokens", ylabel="GiB", title="memory")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"jlco prefill, {report['config']}, {report.get('model', '')}", fontsize=9)
    fig.tight_layout()
    with atomic.temp_sibling(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def check_flags() -> tuple[list[int], pathlib.Path, pathlib.Path]:
    lengths = _lengths()
    resolve_config(FLAGS.config)
    for name in ("mem_gbps", "peak_gflops"):
        v = getattr(FLAGS, name)
        if v is not None and not v > 0:
            raise ValueError(f"--{name}={v}: allowed a positive number (or none: measured "
                             "on this machine)")
    from jlco.planning.hardware import HARDWARE
    hw = FLAGS.hardware.lower()
    if hw not in ("auto", "cpu") and hw not in HARDWARE:
        raise ValueError(f"--hardware={FLAGS.hardware}: allowed auto, cpu, " + ", ".join(HARDWARE))
    json_out = pathlib.Path(FLAGS.json_out or REPO / "out" / "bench_prefill.json")
    png_out = pathlib.Path(FLAGS.png_out or REPO / "out" / "bench_prefill.png")
    for path, flag in ((json_out, "--json_out"), (png_out, "--png_out")):
        atomic.check_writable(path, flag)
    return lengths, json_out.expanduser(), png_out.expanduser()


def parent() -> None:
    with cli.errors_exit(PROG, ValueError, OSError):
        lengths, json_out, png_out = check_flags()
    t0 = time.perf_counter()
    rows = []
    for i, n in enumerate(lengths, 1):
        _say(f"[{n}] length {i}/{len(lengths)}: starting a child process")
        rows.append(run_length(n))
    ok = [r for r in rows if "error" not in r]
    report = dict(config=str(resolve_config(FLAGS.config)), command=" ".join(sys.argv),
                  checkpoint=FLAGS.checkpoint, rows=rows, wall_s=time.perf_counter() - t0,
                  **({k: ok[0][k] for k in ("model", "device", "roofline_machine")} if ok else {}))
    json_out.parent.mkdir(parents=True, exist_ok=True)
    png_out.parent.mkdir(parents=True, exist_ok=True)
    plot(report, png_out)
    summary = table(rows) + (f"\n{report.get('model', '')}; {report.get('device', '')}; "
                             f"wall {report['wall_s']:.0f} s; JSON {json_out}; plot {png_out}")
    cli.write_report(json_out, report, summary, FLAGS.json)
    if len(ok) < len(rows):
        cli.fail(PROG, f"{len(rows) - len(ok)} length(s) failed (see the table)", cli.FAILURE_EXIT)


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    if FLAGS.child_length is None:
        parent()
        return
    with cli.errors_exit(PROG, ValueError, OSError):
        row = child(FLAGS.child_length)
    print(RESULT_TAG + cli.report_json(row, indent=None), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli.flags_parser(PROG))
