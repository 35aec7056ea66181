"""Tune the offload knobs on a short real-engine workload and write the winning config.

Every candidate (fetch_chunk_rows x prefetch_threads x hot_buffer_rows x eviction x
fetch_path x storage x split_attention x prefetch_ahead x prefetch_depth; "auto" values
of the chunk and depth are derived at start-up, `jlco.engine.fetch_schedule`, and each
trial reports what they resolved to) builds a real `jlco.engine.core.Engine` on the same
model, compiles it
with a short warm-up run of the workload (not timed), then decodes the workload
`--repeats` times and reports the median pass by throughput:

  throughput   generated tokens / wall seconds over pure decode steps (steps that admit
               and prefill a request are left out, so the figure is decode throughput);
  TPOT         wall milliseconds per pure decode step: mean and p90.

The winner is the highest throughput whose TPOT (`--tpot_stat`) is within `--tpot_ms`;
it is written to `--output` as a python config (`CONFIG = Config(...)`, loadable by
`jlco.config.load_config`). Offload settings must never change results: every candidate's
tokens are compared with the offload-off reference run (or the first candidate) and any
mismatch fails the tool (exit 1, no config written). Candidates the engine does not
implement (it raises NotImplementedError, e.g. fetch_path='in_jit' with storage='file')
are reported as "unsupported" with its message and do not count against `--max_trials`.
Each candidate compiles, so grids are small by default.

  python tools/tune.py --config configs/tiny.py --output /tmp/tiny_tuned.py --tpot_ms 50
  python tools/tune.py --config configs/32k.py --checkpoint /ckpt/v32 --batch 8 \
      --prompt_len 4096 --gen_len 64 --hot_buffer_rows 1x,2x,4x --output tuned_32k.py
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import sys
import time

import jax
import numpy as np
from absl import app, flags

from jlco.config import Config, ConfigError, load_config
from jlco.engine.core import Engine
from jlco.util import atomic, cli, compile_cache

FLAGS = flags.FLAGS
PROG = "tune"


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("config", None, "python config file (configs/*.py)")
    flags.DEFINE_string("checkpoint", "", "HF or jlco Orbax checkpoint (default: random weights)")
    flags.DEFINE_string("output", "", "write the winning config here (python, CONFIG = Config(...))")
    flags.DEFINE_list("fetch_chunk_rows", ["auto", "256"], "cache.fetch_chunk_rows values "
                      "(rows, or 'auto': derived from the measured transfer path)")
    flags.DEFINE_list("prefetch_threads", [], "cache.prefetch_threads values (default: the config's)")
    flags.DEFINE_list("hot_buffer_rows", ["1x", "2x"], "cache.hot_buffer_rows values: rows, or "
                      "'Nx' = N x Config.min_hot_buffer_rows")
    # The knobs' old names stay accepted as flags for one release (jlco.config.RENAMED).
    flags.DEFINE_alias("prefetch_window", "fetch_chunk_rows")
    flags.DEFINE_alias("staging_capacity", "hot_buffer_rows")
    flags.DEFINE_list("eviction", ["lru", "fifo"], "cache.eviction values")
    flags.DEFINE_list("fetch_path", ["in_jit", "host_driven"], "cache.fetch_path values")
    flags.DEFINE_list("storage", [], "cache.storage values (default: the config's; 'file' needs "
                      "cache.storage_path in the config)")
    flags.DEFINE_list("split_attention", [], "cache.split_attention values (true/false; "
                      "default: the config's; host-driven candidates only)")
    flags.DEFINE_list("prefetch_ahead", [], "cache.prefetch_ahead values (true/false; "
                      "default: the config's; host-driven candidates only)")
    flags.DEFINE_list("prefetch_depth", [], "cache.prefetch_depth values (1..4 or 'auto'; "
                      "default: the config's)")
    flags.DEFINE_integer("max_trials", 8, "most candidates compiled and timed (the config's own "
                         "knobs first; unsupported ones cost nothing and are not counted)",
                         lower_bound=1)
    flags.DEFINE_integer("repeats", 3, "timed passes of the workload per candidate (the median "
                         "pass by throughput is reported; a busy machine makes single passes noisy)",
                         lower_bound=1)
    flags.DEFINE_integer("num_requests", 4, "requests in the workload", lower_bound=1)
    flags.DEFINE_integer("prompt_len", 64, "prompt tokens per request", lower_bound=1)
    flags.DEFINE_integer("gen_len", 16, "generated tokens per request", lower_bound=1)
    flags.DEFINE_integer("batch", 0, "engine.max_batch_size (0 = the config's)", lower_bound=0)
    flags.DEFINE_integer("max_context_len", 0, "engine.max_context_len (0 = the config's)",
                         lower_bound=0)
    flags.DEFINE_float("tpot_ms", 0.0, "TPOT limit in ms (0 = none)", lower_bound=0.0)
    flags.DEFINE_enum("tpot_stat", "mean", ["mean", "p90"], "which TPOT the limit applies to")
    flags.DEFINE_bool("reference", True, "also run offload off as the token reference")
    flags.DEFINE_string("impl", "", "attention impl (default: 'xla' on CPU, else the config's)")
    flags.DEFINE_integer("seed", 0, "prompt and candidate-order seed", lower_bound=0)
    flags.DEFINE_bool("json", False, "print JSON instead of the table")


KNOBS = ("fetch_chunk_rows", "prefetch_threads", "hot_buffer_rows", "eviction", "fetch_path",
         "storage", "split_attention", "prefetch_ahead", "prefetch_depth")
# Knobs a grid may leave out (then the base config's value): the host-driven scheduling.
OPTIONAL = ("split_attention", "prefetch_ahead", "prefetch_depth")
HOST_DRIVEN_ONLY = ("split_attention", "prefetch_ahead")


class TokenMismatch(RuntimeError):
    """A candidate generated different tokens than the reference: an offload bug."""


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list
    gen_len: int

    @classmethod
    def random(cls, vocab: int, num_requests: int, prompt_len: int, gen_len: int,
               seed: int = 0) -> "Workload":
        for name, v in (("num_requests", num_requests), ("prompt_len", prompt_len),
                        ("gen_len", gen_len)):
            if v < 1:
                raise ValueError(f"{name}={v} is invalid: allowed a positive integer")
        rng = np.random.default_rng(seed)
        return cls([rng.integers(0, vocab, prompt_len).tolist() for _ in range(num_requests)],
                   gen_len)


def parse_capacity(value: str, cfg: Config) -> int:
    """'64' → 64 rows; '2x' → 2 x min_hot_buffer_rows (index_topk x (1 + drafts))."""
    v = str(value).strip()
    try:
        return int(float(v[:-1]) * cfg.min_hot_buffer_rows) if v.endswith("x") else int(v)
    except ValueError:
        raise ValueError(f"hot_buffer_rows={value!r} is invalid: allowed rows (int) or "
                         f"'Nx' (N x min_hot_buffer_rows={cfg.min_hot_buffer_rows})") from None


def candidates(base: Config, grid: dict, seed: int = 0) -> list[Config]:
    """Configs for the grid's product, offload on: the base config's own knobs first
    (when in the grid), the rest in a seeded shuffle. Knobs in OPTIONAL may be left out
    (the base config's value); combinations that turn a HOST_DRIVEN_ONLY knob on with
    the in-jit path are left out (the config refuses them). Invalid values raise
    ConfigError here, before anything compiles."""
    missing = set(KNOBS) - set(grid) - set(OPTIONAL)
    if missing:
        raise ValueError(f"grid is missing knobs {sorted(missing)}: allowed keys {KNOBS}")
    base = base.replace(cache__offload=True)
    grid = {k: grid.get(k, [getattr(base.cache, k)]) for k in KNOBS}
    combos = [c for c in itertools.product(*(grid[k] for k in KNOBS))
              if _host_driven(dict(zip(KNOBS, c))) or not any(
                  dict(zip(KNOBS, c))[k] for k in HOST_DRIVEN_ONLY)]
    own = tuple(getattr(base.cache, k) for k in KNOBS)
    rest = [c for c in combos if c != own]
    np.random.default_rng(seed).shuffle(rest)
    ordered = ([own] if own in combos else []) + rest
    return [base.replace(**{f"cache__{k}": v for k, v in zip(KNOBS, c)}) for c in ordered]


def _host_driven(k: dict) -> bool:
    return k["fetch_path"] == "host_driven" or (k["fetch_path"] == "auto"
                                                and k["storage"] == "file")


def _decode_pass(eng: Engine, work: Workload) -> dict:
    """Decode the workload once; time only steps that admit and prefill nothing (pure
    decode). With async scheduling a step's tokens are emitted by the next call (the
    first call only queues, the last only emits): every such call's wall counts toward
    throughput, the calls that emitted tokens are the steps."""
    reqs = [eng.submit(p, work.gen_len) for p in work.prompts]
    walls, tokens, spent = [], 0, 0.0
    while True:
        admitting = bool(eng.scheduler.waiting) or eng.num_prefilling > 0
        before = sum(len(r.tokens) for r in reqs)
        t = time.perf_counter()
        ran = eng.step()
        wall, got = time.perf_counter() - t, sum(len(r.tokens) for r in reqs) - before
        if not admitting and (ran or got):
            spent, tokens = spent + wall, tokens + got
            if got:
                walls.append(wall)
        if not ran:
            break
    eng.check_no_leaks()
    ms = np.asarray(walls) * 1e3 if walls else np.full(1, np.nan)
    return dict(decode_steps=len(walls), decode_tokens=tokens,
                throughput_tok_s=tokens / spent if walls else float("nan"),
                tpot_ms_mean=float(ms.mean()), tpot_ms_p90=float(np.percentile(ms, 90)),
                tokens=[list(r.tokens) for r in reqs])


def measure(cfg: Config, model, work: Workload, impl: str, repeats: int = 3) -> dict:
    """Build and warm up (compile) one engine, then decode the workload `repeats` times;
    the pass with the median throughput is reported."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is invalid: allowed a positive integer")
    t0 = time.perf_counter()
    try:
        eng = Engine(cfg, model, impl=impl)
    except NotImplementedError as e:
        return dict(status="unsupported", message=str(e))
    eng.generate(work.prompts, min(2, work.gen_len))   # compiles prefill, install, step
    compile_s = time.perf_counter() - t0
    if eng.metrics is not None:
        eng.metrics.reset()
    passes = [_decode_pass(eng, work) for _ in range(repeats)]
    order = sorted(range(repeats), key=lambda i: passes[i]["throughput_tok_s"])
    out = dict(status="ok", compile_s=compile_s, **passes[order[repeats // 2]],
               throughput_runs=[p["throughput_tok_s"] for p in passes],
               repeats_agree=all(p["tokens"] == passes[0]["tokens"] for p in passes),
               hit_rate=None)
    if eng.metrics is not None:
        out["hit_rate"] = eng.metrics.snapshot()["total"]["hit_rate"]
        out["health"] = eng.metrics.health()["total"]
        out["derived"] = derived(eng)
    return out


def derived(eng: Engine) -> dict:
    """What "auto" resolved to in this engine: the fetch chunk's rows (host-driven: the
    fetcher's; in-jit: the latent's) and the prefetch depth after the last step."""
    host = eng.runner.host
    if host is None:
        return dict(fetch_chunk_rows=eng.runner.cache.latent.chunk_rows, prefetch_depth=None)
    return dict(fetch_chunk_rows=host.fetcher.window,
                prefetch_depth=None if host.depth is None else host.depth.depth)


def knobs(cfg: Config) -> dict:
    return {k: getattr(cfg.cache, k) for k in KNOBS}


def tune(cands: list[Config], model, work: Workload, *, impl: str, max_trials: int = 8,
         repeats: int = 3, reference: Config | None = None, progress=None) -> dict:
    """Run candidates in order until `max_trials` have compiled and run (unsupported ones
    are recorded but not counted), the offload-off reference first when given. Returns
    {"reference": trial | None, "trials": [trial, ...]}, each trial with its knobs,
    status, figures and `tokens_match` (against the reference, else the first
    successful candidate, and across its own repeats)."""
    if max_trials < 1:
        raise ValueError(f"max_trials={max_trials} is invalid: allowed a positive integer")
    say = progress or (lambda msg: None)
    ref_trial = None
    if reference is not None:
        say("[ref] offload off: compiling and decoding ...")
        ref_trial = dict(knobs=None, offload=False,
                         **measure(reference, model, work, impl, repeats))
        say(f"[ref] {_summary(ref_trial)}")
    trials, want = [], ref_trial["tokens"] if ref_trial and ref_trial["status"] == "ok" else None
    for i, cfg in enumerate(cands):
        if sum(t["status"] == "ok" for t in trials) >= max_trials:
            break
        label = " ".join(f"{k}={v}" for k, v in knobs(cfg).items())
        say(f"[{i + 1}/{len(cands)}] {label}: compiling and decoding ...")
        tr = dict(knobs=knobs(cfg), offload=True, **measure(cfg, model, work, impl, repeats))
        if tr["status"] == "ok":
            want = tr["tokens"] if want is None else want
            tr["tokens_match"] = tr["repeats_agree"] and tr["tokens"] == want
        trials.append(tr)
        say(f"[{i + 1}/{len(cands)}] {label}: {_summary(tr)}")
    return dict(reference=ref_trial, trials=trials)


def check_tokens(result: dict) -> None:
    """Raise TokenMismatch naming every candidate whose tokens differ."""
    bad = [t["knobs"] for t in result["trials"] if t["status"] == "ok" and not t["tokens_match"]]
    if bad:
        raise TokenMismatch(f"offload settings changed the generated tokens for {len(bad)} "
                            f"candidate(s): {bad}; offload must be exact (this is a bug)")


def pick(trials: list[dict], tpot_ms: float = 0.0, stat: str = "mean") -> dict | None:
    """Highest-throughput successful trial whose TPOT (`stat`) is within tpot_ms
    (0 = no limit); None when no trial qualifies."""
    if stat not in ("mean", "p90"):
        raise ValueError(f"tpot_stat={stat!r} is invalid: allowed 'mean', 'p90'")
    ok = [t for t in trials if t["status"] == "ok"
          and (tpot_ms <= 0 or t[f"tpot_ms_{stat}"] <= tpot_ms)]
    return max(ok, key=lambda t: t["throughput_tok_s"], default=None)


def _summary(t: dict) -> str:
    if t["status"] != "ok":
        return f"{t['status']}: {t['message']}"
    hr = "" if t["hit_rate"] is None else f", hit rate {t['hit_rate']:.3f}"
    return (f"{t['throughput_tok_s']:.1f} tok/s, TPOT {t['tpot_ms_mean']:.2f} ms "
            f"(p90 {t['tpot_ms_p90']:.2f}){hr}, compile {t['compile_s']:.1f} s")


def render_config(cfg: Config, doc: str = "") -> str:
    """Python source for `cfg` in the style of configs/*.py: each dataclass as
    `Name(field=value, ...)` listing the fields that differ from its defaults."""
    names: set[tuple[str, str]] = set()      # (module, class): a V4Config has its own
    body = _render(cfg, 0, names)
    doc = doc.replace('"""', "'''").strip()
    head = f'"""{doc}\n"""\n' if doc else ""
    imports = "".join(
        f"from {mod} import {', '.join(sorted(n for m, n in names if m == mod))}\n"
        for mod in sorted({m for m, _ in names}))
    return f"{head}{imports}\nCONFIG = {body}\n"


def _render(obj, indent: int, names: set) -> str:
    if dataclasses.is_dataclass(obj):
        cls = type(obj)
        names.add((cls.__module__, cls.__name__))
        default = cls()
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)
                 if getattr(obj, f.name) != getattr(default, f.name)]
        if not items:
            return f"{cls.__name__}()"
        pad = " " * (indent + 4)
        inner = "".join(f"{pad}{k}={_render(v, indent + 4, names)},\n" for k, v in items)
        return f"{cls.__name__}(\n{inner}{' ' * indent})"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return repr(obj)
    if isinstance(obj, tuple) and all(x is None or isinstance(x, (bool, int, float, str))
                                      for x in obj):
        return repr(obj)     # per-layer patterns (model.indexer_types, mlp_layer_types)
    raise TypeError(f"render_config: cannot write {type(obj).__name__} value {obj!r}")


def write_config(cfg: Config, path: str | pathlib.Path, doc: str = "") -> None:
    """Write `cfg` as a config file, atomically: it is written beside `path`, read back
    (it must load to `cfg`) and only then renamed onto `path`, so `path` never holds a
    half-written or wrong config."""
    path = pathlib.Path(path)
    with atomic.temp_sibling(path, suffix=".py") as tmp:
        tmp.write_text(render_config(cfg, doc))
        back = load_config(tmp)
        if back != cfg:
            raise RuntimeError(f"{path}: written config does not load back equal to the winner")


def _table(report: dict) -> str:
    cols = ("window", "threads", "staging", "evict", "fetch", "storage", "split", "ahead",
            "depth", "tok/s", "tpot ms", "p90 ms", "hit rate", "tokens", "status")
    lines = [" ".join(f"{c:>9}" for c in cols)]
    ref = report["reference"]
    rows = ([("offload off (reference)", ref)] if ref else []) + [
        (" ".join(f"{str(v):>9}" for v in t["knobs"].values()), t) for t in report["trials"]]
    for label, t in rows:
        if t["status"] != "ok":
            lines.append(f"{label} {t['status']}: {t['message'][:70]}")
            continue
        hr = "-" if t["hit_rate"] is None else f"{t['hit_rate']:.3f}"
        same = "ref" if t.get("tokens_match") is None else ("same" if t["tokens_match"]
                                                            else "DIFFER")
        lines.append(f"{label:>89} {t['throughput_tok_s']:9.1f} {t['tpot_ms_mean']:9.2f} "
                     f"{t['tpot_ms_p90']:9.2f} {hr:>9} {same:>9} {'ok':>9}")
    w = report.get("winner")
    lines.append("winner: " + (json.dumps(w["knobs"]) if w else "none") +
                 (f" -> {report['output']}" if report.get("output") else ""))
    return "\n".join(lines)


def _load(cfg: Config):
    """(cfg, model): random weights from cfg.model, or the checkpoint's model (in the
    dtype its config.json names, else bfloat16, as `jlco.generate` does), whose own
    model config then replaces cfg.model (cache/engine sections stay the config's)."""
    if FLAGS.checkpoint:
        from jlco.checkpoint.load import checkpoint_dtype, load_model
        dtype = checkpoint_dtype(FLAGS.checkpoint)[0] or "bfloat16"
        mcfg, model, _ = load_model(FLAGS.checkpoint, {"dtype": dtype})
        return cfg.replace(model=mcfg), model
    from flax import nnx

    from jlco.model.decoder import DeepseekV32
    return cfg, DeepseekV32(cfg.model, rngs=nnx.Rngs(cfg.engine.seed))


def _ints(name: str, values) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--{name}={','.join(map(str, values))} is invalid: allowed a "
                         "comma-separated list of integers") from None


def _auto_or_ints(name: str, values) -> list:
    return [v if v == "auto" else _ints(name, [v])[0] for v in values]


def _bools(name: str, values, default: bool) -> list[bool]:
    table = {"true": True, "false": False, "1": True, "0": False}
    bad = [v for v in values if str(v).lower() not in table]
    if bad:
        raise ValueError(f"--{name}={','.join(map(str, values))} is invalid: allowed a "
                         "comma-separated list of true/false")
    return [table[str(v).lower()] for v in values] or [default]


def _grid(cfg: Config) -> dict:
    threads = FLAGS.prefetch_threads or [cfg.cache.prefetch_threads]
    c = cfg.cache
    return dict(fetch_chunk_rows=_auto_or_ints("fetch_chunk_rows", FLAGS.fetch_chunk_rows),
                split_attention=_bools("split_attention", FLAGS.split_attention,
                                       c.split_attention),
                prefetch_ahead=_bools("prefetch_ahead", FLAGS.prefetch_ahead, c.prefetch_ahead),
                prefetch_depth=_auto_or_ints("prefetch_depth", FLAGS.prefetch_depth)
                or [c.prefetch_depth],
                prefetch_threads=_ints("prefetch_threads", threads),
                hot_buffer_rows=sorted({parse_capacity(v, cfg) for v in FLAGS.hot_buffer_rows}),
                eviction=list(FLAGS.eviction), fetch_path=list(FLAGS.fetch_path),
                storage=list(FLAGS.storage) or [cfg.cache.storage])


def _workload_cfg(cfg: Config) -> Config:
    over = {}
    if FLAGS.batch:
        over["engine__max_batch_size"] = FLAGS.batch
    if FLAGS.max_context_len:
        over["engine__max_context_len"] = FLAGS.max_context_len
    return cfg.replace(**over) if over else cfg


def _prepare():
    """(cfg, candidates, workload, model): every check of the flags, the config, the
    output path and the checkpoint, before anything compiles."""
    if not FLAGS.config:
        raise ValueError("--config is required (a python config file, configs/*.py)")
    cfg = _workload_cfg(load_config(FLAGS.config))
    cands = candidates(cfg, _grid(cfg), FLAGS.seed)
    work = Workload.random(cfg.model.vocab_size, FLAGS.num_requests, FLAGS.prompt_len,
                           FLAGS.gen_len, FLAGS.seed)
    if FLAGS.output:
        atomic.check_writable(FLAGS.output, "--output")
    cfg, model = _load(cfg)
    return cfg, cands, work, model


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    compile_cache.enable()
    with cli.errors_exit(PROG, ConfigError, ValueError, OSError):
        cfg, cands, work, model = _prepare()
    cands = [c.replace(model=cfg.model) for c in cands]
    impl = FLAGS.impl or ("xla" if jax.default_backend() == "cpu" else cfg.engine.attention_impl)
    ref = cfg.replace(cache__offload=False) if FLAGS.reference else None
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report = tune(cands, model, work, impl=impl, max_trials=FLAGS.max_trials,
                  repeats=FLAGS.repeats, reference=ref, progress=say)
    report.update(config=FLAGS.config, impl=impl, backend=jax.default_backend(),
                  workload=dict(num_requests=len(work.prompts), prompt_len=FLAGS.prompt_len,
                                gen_len=work.gen_len, batch=cfg.engine.max_batch_size),
                  tpot_ms=FLAGS.tpot_ms, tpot_stat=FLAGS.tpot_stat, output=None)
    code = 0
    try:
        check_tokens(report)
        win = pick(report["trials"], FLAGS.tpot_ms, FLAGS.tpot_stat)
        report["winner"] = win and dict(knobs=win["knobs"],
                                        throughput_tok_s=win["throughput_tok_s"])
        if win is None:
            say(f"no candidate ran within TPOT {FLAGS.tpot_stat} <= {FLAGS.tpot_ms} ms")
            code = 2
        elif FLAGS.output:
            i = next(i for i, t in enumerate(report["trials"]) if t is win)
            best = cands[i].replace(name=f"{cfg.name}_tuned")
            write_config(best, FLAGS.output, _doc(report, win))
            report["output"] = FLAGS.output
    except TokenMismatch as e:
        say(f"ERROR: {e}")
        report["winner"], code = None, 1
    for t in [report["reference"]] + report["trials"]:
        if t is not None:
            t.pop("tokens", None)
    print(cli.report_json(report) if FLAGS.json else _table(report))
    sys.exit(code)


def _doc(report: dict, win: dict) -> str:
    w = report["workload"]
    return (f"Offload knobs tuned by tools/tune.py from {report['config']} on {report['backend']} "
            f"({report['impl']} attention).\n\nWorkload: {w['num_requests']} requests x "
            f"{w['prompt_len']} prompt + {w['gen_len']} generated tokens, batch {w['batch']}. "
            f"Winner of {len(report['trials'])} candidates:\n"
            f"{win['throughput_tok_s']:.1f} tok/s, TPOT mean {win['tpot_ms_mean']:.2f} ms, "
            f"p90 {win['tpot_ms_p90']:.2f} ms.")


if __name__ == "__main__":
    define_flags()
    app.run(main)
