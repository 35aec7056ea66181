"""jlco against llama.cpp, the engine a CPU user would run DeepSeek-V3.2 with, on one
checkpoint and the same prompts, with the measured roofline beside every figure.

One random DeepseekV32 checkpoint is built from `--config` (default
configs/bench_llamacpp.py: the issue's 35.7 M-parameter float32 shape) by `transformers`
and saved with `save_pretrained`; jlco loads it with its own loader, llama.cpp reads the
GGUF that llama.cpp's own converter (`convert_hf_to_gguf.py` from the llama-cpp-python
sdist, `--llama_cpp_src`) writes from it, float32 weights. The converter wants a tokenizer
with merges: a byte-level BPE is trained here with `tokenizers` (the prompts are token
ids, so it only has to exist); it refuses tokenizers it does not know by hash, so its
pre-tokenizer check is bypassed (tokenization is never used).

For each `--contexts` length and `--batches` size: `batch` random prompts of `context`
tokens, then `--new_tokens` greedy tokens each. Each engine measures each setting in a
process of its own (run one after another in one process, a later setting ran slower:
jlco's 8K batch-4 step 59.4 ms after the batch-1 setting, 28.7 ms alone). Measured per
engine, after a warm-up round
of the same shapes (jlco's compiles; llama.cpp's buffers), median of `--rounds`; every
round draws new prompts (both engines get the same ones), and jlco's prefix cache is off,
so neither engine reuses a cached prompt (llama.cpp clears its KV cache each round):
  prefill  all prompts to their first token (jlco: `Engine.admit`, chunked as
           `engine.prefill_chunk`; llama.cpp: `llama_decode` over `n_batch`-token pieces);
  decode   tokens/s over the remaining steps (batch tokens per step) and the step p50.
llama.cpp runs with `n_seq_max = batch` (one sequence per prompt), all cores, flash
attention, and its KV cache in `--kv_type` (f32 computes the tokens jlco and
transformers compute; f16 is its default). The greedy tokens of both are compared.

Rooflines come from this machine, measured at the start (`jlco.planning.probe`: read
bandwidth at the model's working-set size with every core, f32 matmul rate), unless
`--mem_gbps` / `--peak_gflops` are given; `jlco.planning.roofline` counts the bytes and
FLOPs (decode: one step at the context; prefill: the prompt as one step of `context`
queries over an empty cache, per request).

Needs the optional extra: pip install -e '.[llamacpp]' (builds llama.cpp, ~15 min on
2 cores), and the sdist for the converter:
  pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/llsdist
  tar xzf /tmp/llsdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsdist

  python tools/bench_vs_llamacpp.py --contexts=2048,8192,32768 --batches=1,4 \\
      --llama_cpp_src=/tmp/llsdist/llama_cpp_python-0.3.36/vendor/llama.cpp --out=out/vs_llamacpp

Long contexts take long (32K at batch 1: minutes of prefill per round), so contexts are
often run apart; `--merge=a/vs_llamacpp.json,b/vs_llamacpp.json --out=out/all` writes one
table, JSON and plot over them (each setting keeps its own run's machine reading), the
plot with jlco ÷ llama.cpp beside the issue's 1.0× and 1.5× bars.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import flags

from jlco.util import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROG = "bench_vs_llamacpp"
FLAGS = flags.FLAGS

# Run in a child python: the converter's modules on sys.path, its tokenizer-hash check
# (which knows only published tokenizers) and its BOS assertion bypassed.
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
import conversion.deepseek as deepseek
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
convert_hf_to_gguf.main()
"""


def define_flags() -> None:
    flags.DEFINE_string("config", "configs/bench_llamacpp.py", "model config (random weights)")
    flags.DEFINE_list("contexts", ["2048", "8192", "32768"], "prompt tokens per request")
    flags.DEFINE_list("batches", ["1", "4"], "requests decoded together")
    flags.DEFINE_integer("new_tokens", 16, "greedy tokens per request", lower_bound=2)
    flags.DEFINE_integer("rounds", 1, "timed rounds per setting (median)", lower_bound=1)
    flags.DEFINE_integer("prefill_chunk", 512, "jlco engine.prefill_chunk (--jlco_as=engine)",
                         lower_bound=1)
    flags.DEFINE_enum("jlco_as", "engine", list(JLCO_AS), "engine: jlco's Engine in-process "
                      "with this tool's settings (--prefill_chunk); cli: `python -m "
                      "jlco.generate --checkpoint DIR --prompts_file F --json` with no "
                      "--config, one process per round, its own timing figures")
    flags.DEFINE_integer("n_batch", 512, "llama.cpp n_batch / n_ubatch", lower_bound=1)
    flags.DEFINE_enum("kv_type", "f32", ["f32", "f16"], "llama.cpp KV-cache type")
    flags.DEFINE_string("llama_cpp_src", os.environ.get("LLAMA_CPP_SRC", ""),
                        "llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py")
    flags.DEFINE_float("init_std", 0.05, "weight init std of the random checkpoint")
    flags.DEFINE_float("mem_gbps", 0.0, "roofline bandwidth, GB/s (0 = measure)")
    flags.DEFINE_float("peak_gflops", 0.0, "roofline f32 peak, GFLOP/s (0 = measure)")
    flags.DEFINE_multi_string("override", [], "jlco config override section.field=value "
                              "(repeatable), e.g. engine.async_scheduling=false for an A/B")
    flags.DEFINE_string("child", "", "internal: ENGINE:CONTEXT:BATCH:DIR, one engine's "
                        "measurement in a process of its own (set by this tool)")
    flags.DEFINE_list("merge", [], "instead of measuring: JSON files of earlier runs "
                      "(one table and plot over all their settings, each with its run's "
                      "machine reading)")
    flags.DEFINE_string("out", "out/vs_llamacpp", "directory for the JSON and PNG")
    flags.DEFINE_bool("json", False, "print the JSON to stdout (the table to stderr)")


def _cpu_model() -> str:
    """The CPU's model name and its widest vector extension (the engines' kernels
    differ most by it), from /proc/cpuinfo; "" where there is none."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "")
    flags_ = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                       if ln.startswith("flags")), []))
    simd = next((f for f in ("avx512f", "avx2", "avx", "neon") if f in flags_), "")
    return f"{name} ({simd})" if simd else name


def _ints(name: str, values: list[str]) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        cli.fail(PROG, f"--{name}={','.join(values)}: allowed positive integers")
    if not out or min(out) < 1:
        cli.fail(PROG, f"--{name}={','.join(values)}: allowed positive integers")
    return out


def write_checkpoint(cfg, d: str) -> None:
    """transformers' random model, a byte-level BPE tokenizer, and the config keys the
    converter reads (`scoring_func` / `topk_method`: what DeepSeek-V3's own config.json
    says, and what transformers' DeepseekV32 computes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jlco.checkpoint.hf_reference import build_hf_model
    build_hf_model(cfg.model, init_std=FLAGS.init_std).save_pretrained(d)
    path = os.path.join(d, "config.json")
    hf = json.load(open(path))
    hf.update(scoring_func="sigmoid", topk_method="noaux_tc")
    json.dump(hf, open(path, "w"), indent=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [" ".join(f"word{i} token{i % 97} piece{i % 13}" for i in range(j, j + 200))
            for j in range(0, 20000, 200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=cfg.model.vocab_size - 2, special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(os.path.join(d, "tokenizer.json"))
    json.dump(dict(add_bos_token=True, bos_token="<bos>", eos_token="<eos>",
                   tokenizer_class="PreTrainedTokenizerFast"),
              open(os.path.join(d, "tokenizer_config.json"), "w"))


def convert(ckpt: str, gguf: str) -> None:
    src = FLAGS.llama_cpp_src
    if not src or not os.path.exists(os.path.join(src, "convert_hf_to_gguf.py")):
        cli.fail(PROG, f"--llama_cpp_src={src!r}: allowed a llama.cpp source tree with "
                       "convert_hf_to_gguf.py and gguf-py (see this tool's docstring)")
    print("converting the checkpoint to GGUF (llama.cpp's converter) ...", file=sys.stderr)
    run = subprocess.run([sys.executable, "-c", _CONVERT, src, ckpt, "--outfile", gguf,
                          "--outtype", "f32"], capture_output=True, text=True)
    if run.returncode != 0:
        cli.fail(PROG, f"convert_hf_to_gguf.py failed:\n{run.stderr[-3000:]}", cli.FAILURE_EXIT)


class LlamaCpp:
    """llama.cpp through llama-cpp-python's C API: one context of `batch` sequences."""

    def __init__(self, gguf: str, batch: int, context: int):
        import llama_cpp as L
        from llama_cpp import _logger
        _logger.set_verbose(False)   # its load and graph logs; errors still print
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            cli.fail(PROG, f"llama.cpp could not load {gguf}", cli.FAILURE_EXIT)
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cp = L.llama_context_default_params()
        per_seq = context + FLAGS.new_tokens + 8
        cp.n_ctx, cp.n_seq_max = per_seq * batch, batch
        cp.n_batch = cp.n_ubatch = max(FLAGS.n_batch, batch)
        cp.n_threads = cp.n_threads_batch = os.cpu_count()
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        kv = L.GGML_TYPE_F32 if FLAGS.kv_type == "f32" else L.GGML_TYPE_F16
        cp.type_k = cp.type_v = kv
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            cli.fail(PROG, "llama.cpp could not create its context", cli.FAILURE_EXIT)
        self.batch = L.llama_batch_init(cp.n_batch, 0, batch)
        self.n_batch = cp.n_batch

    def close(self) -> None:
        L = self.L
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, out
        if self.L.llama_decode(self.ctx, b) != 0:
            cli.fail(PROG, "llama_decode failed", cli.FAILURE_EXIT)

    def _argmax(self, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.vocab,))))

    def run(self, prompts: list[list[int]]) -> dict:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        t = time.perf_counter()
        first = []
        for s, p in enumerate(prompts):
            for lo in range(0, len(p), self.n_batch):
                piece = p[lo:lo + self.n_batch]
                self._decode([(tok, lo + j, s, lo + j == len(p) - 1)
                              for j, tok in enumerate(piece)])
            first.append(self._argmax(len(piece) - 1))
        prefill = time.perf_counter() - t
        tokens, steps = [[f] for f in first], []
        for k in range(FLAGS.new_tokens - 1):
            t = time.perf_counter()
            self._decode([(tokens[s][-1], len(p) + k, s, True) for s, p in enumerate(prompts)])
            nxt = [self._argmax(s) for s in range(len(prompts))]
            steps.append(time.perf_counter() - t)
            for s, n in enumerate(nxt):
                tokens[s].append(n)
        return dict(prefill_s=prefill, step_s=steps, tokens=tokens)


class Jlco:
    """jlco's engine on the same checkpoint, as `jlco.generate --prompts_file` runs it."""

    def __init__(self, ckpt: str, batch: int, context: int):
        from jlco.checkpoint.load import load_model
        from jlco.config import load_config
        from jlco.engine.core import Engine
        from jlco.config import apply_overrides
        base = apply_overrides(load_config(ROOT / FLAGS.config), FLAGS.override)   # checked
        mcfg, model, _ = load_model(ckpt, {"dtype": "float32"}, progress=False)
        self.cfg = base.replace(model=mcfg, engine__max_batch_size=batch,
                                engine__max_context_len=context + FLAGS.new_tokens + 8,
                                engine__prefill_chunk=FLAGS.prefill_chunk,
                                cache__prefix_cache=False)
        self.eng = Engine(self.cfg, model)

    def close(self) -> None:
        self.eng.close()

    def run(self, prompts: list[list[int]]) -> dict:
        eng = self.eng
        reqs = [eng.submit(p, FLAGS.new_tokens) for p in prompts]
        t = time.perf_counter()
        eng.admit()
        prefill = time.perf_counter() - t
        eng.step_seconds.clear()
        eng.run()
        return dict(prefill_s=prefill, step_s=list(eng.step_seconds),
                    tokens=[list(r.tokens) for r in reqs])


class JlcoCli:
    """jlco as a user runs it: `python -m jlco.generate --checkpoint DIR --prompts_file F
    --json` with no --config (the engine sized from the checkpoint and the prompts), one
    process per round; its own `timing` is the figure (`decode_tokens_per_s`, the step
    p50, and `prefill_s` less `prefill_compile_s`, as llama.cpp's prefill leaves out its
    model load; each round's whole timing and wall time are kept in the JSON). The
    warm-up round fills the persistent compilation cache, as a user's first run does."""

    def __init__(self, ckpt: str, batch: int, context: int):
        self.ckpt, self.runs = ckpt, 0

    def close(self) -> None:
        pass

    def run(self, prompts: list[list[int]]) -> dict:
        self.runs += 1
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(p) + "\n" for p in prompts))
        cmd = [sys.executable, "-m", "jlco.generate", "--checkpoint", self.ckpt,
               "--prompts_file", f.name, "--max_new_tokens", str(FLAGS.new_tokens),
               "--dtype", "float32", "--json", *[a for o in FLAGS.override
                                                 for a in ("--override", o)]]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        os.unlink(f.name)
        if proc.returncode != 0:
            raise RuntimeError(f"jlco.generate failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip().splitlines()[-1:]}")
        out = json.loads(proc.stdout)
        tm = out["timing"]
        tokens = [r["tokens"] for r in out["results"]] if "results" in out else [out["tokens"]]
        # prefill without its compilation (loading, tracing, lowering: per process, like
        # llama.cpp's model load, which its figure leaves out too); both are in cli_timing
        return dict(prefill_s=tm["prefill_s"] - tm["prefill_compile_s"],
                    step_s=[tm["step_ms_p50"] / 1e3],
                    decode_tok_s=tm["decode_tokens_per_s"], tokens=tokens,
                    cli_timing=tm, cli_wall_s=wall)


def measure(engine, rounds_prompts) -> dict:
    """A warm-up round on the first prompts, then one timed round on each of the others
    (new prompts every round: a repeated prompt would be a prefix-cache hit, not a
    prefill): medians, and the last round's tokens."""
    engine.run(rounds_prompts[0])
    rounds = [engine.run(p) for p in rounds_prompts[1:]]
    prefill = float(np.median([r["prefill_s"] for r in rounds]))
    step = float(np.median([np.median(r["step_s"]) for r in rounds]))
    prompts = rounds_prompts[-1]
    n = sum(len(p) for p in prompts)
    out = dict(prefill_s=prefill, prefill_tok_s=n / prefill, step_ms=1e3 * step,
               decode_tok_s=len(prompts) / step, tokens=rounds[-1]["tokens"])
    if "cli_timing" in rounds[-1]:   # the CLI's own decode figure, not one from its p50
        out["decode_tok_s"] = float(np.median([r["decode_tok_s"] for r in rounds]))
        out.update(cli_timing=[r["cli_timing"] for r in rounds],
                   cli_wall_s=[r["cli_wall_s"] for r in rounds])
    return out


ENGINES = {"jlco": Jlco, "llamacpp": LlamaCpp}
JLCO_AS = {"engine": Jlco, "cli": JlcoCli}   # --jlco_as: how the "jlco" side runs
MODEL_FILES = {"jlco": "hf", "llamacpp": "model.gguf"}   # what each reads, in the run's dir


def measure_child(spec: str) -> None:
    """`--child=ENGINE:CONTEXT:BATCH:DIR`: one engine on one setting in this process (the
    prompts, checkpoint and GGUF are in DIR); its `measure` dict to DIR/ENGINE.json."""
    try:
        name, context, batch, d = spec.split(":", 3)
        context, batch = int(context), int(batch)
        if name not in ENGINES:
            raise ValueError(name)
    except ValueError:
        cli.fail(PROG, f"--child={spec}: allowed ENGINE:CONTEXT:BATCH:DIR with ENGINE one "
                       f"of {', '.join(ENGINES)} (set by this tool itself)")
    prompts = json.loads(pathlib.Path(d, "prompts.json").read_text())
    make = JLCO_AS[FLAGS.jlco_as] if name == "jlco" else ENGINES[name]
    engine = make(os.path.join(d, MODEL_FILES[name]), batch, context)
    try:
        out = measure(engine, prompts)
    finally:
        engine.close()
    pathlib.Path(d, f"{name}.json").write_text(json.dumps(out))


def _in_child(name: str, context: int, batch: int, d: str) -> dict:
    """One engine on one setting in a process of its own (why: the module docstring), so
    neither engine nor an earlier setting leaves threads or memory behind for it."""
    argv = [a for a in sys.argv[1:] if not a.startswith("--child")]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv,
                           f"--child={name}:{context}:{batch}:{d}"])
    if proc.returncode != 0:
        cli.fail(PROG, f"{name} at context {context}, batch {batch} failed "
                       f"(exit {proc.returncode}; its errors are above)", cli.FAILURE_EXIT)
    return json.loads(pathlib.Path(d, f"{name}.json").read_text())


def setting(d: str, cfg, machine, context: int, batch: int) -> dict:
    """Both engines on `batch` prompts of `context` tokens, each engine in its own
    process, on the same prompts (new ones every round)."""
    from jlco.planning import roofline
    rng = np.random.default_rng(context * 10 + batch)
    prompts = [rng.integers(0, cfg.model.vocab_size, (batch, context)).tolist()
               for _ in range(FLAGS.rounds + 1)]
    pathlib.Path(d, "prompts.json").write_text(json.dumps(prompts))
    ours, peer = (_in_child(name, context, batch, d) for name in ENGINES)
    pre_roof = batch * roofline.decode_step_cost(cfg, 1, 0, s_q=context).time_s(machine)
    step_roof = roofline.decode_step_cost(cfg, batch, context).time_s(machine)
    for side in (ours, peer):
        side["prefill_over_roofline"] = side["prefill_s"] / pre_roof
        side["step_over_roofline"] = side["step_ms"] / (1e3 * step_roof)
    return dict(context=context, batch=batch, jlco=ours, llamacpp=peer,
                roofline_prefill_s=pre_roof, roofline_step_ms=1e3 * step_roof,
                prefill_speedup=peer["prefill_s"] / ours["prefill_s"],
                decode_speedup=ours["decode_tok_s"] / peer["decode_tok_s"],
                same_first_tokens=[a[0] == b[0] for a, b in zip(ours["tokens"], peer["tokens"])],
                same_tokens=ours["tokens"] == peer["tokens"])


def _machine_line(m: dict) -> str:
    return (f"{m['mem_gbps']:.1f} GB/s read at {m['working_set_mb']:.0f} MB, "
            f"{m['peak_gflops']:.0f} GFLOP/s f32")


def table(out: dict) -> str:
    if "machine" in out:
        head = f"roofline machine: {_machine_line(out['machine'])}"
    else:   # merged runs: each setting's roofline is from its own run's probe
        head = "roofline machines: " + "; ".join(
            f"{', '.join(str(c) for c in ctxs)}: {_machine_line(m)}"
            for ctxs, m in _runs(out))
    lines = [f"{head}; llama.cpp KV {out['kv_type']}; jlco as "
             f"{out.get('jlco_as', 'engine')}",
             f"{'ctx':>6}{'b':>3} {'engine':9}{'prefill s':>10}{'tok/s':>8}{'x roof':>8}"
             f"{'step ms':>9}{'tok/s':>8}{'x roof':>8}  tokens"]
    for r in out["results"]:
        for name in ("jlco", "llamacpp"):
            s = r[name]
            same = "" if name == "jlco" else ("equal" if r["same_tokens"] else
                                              f"first {sum(r['same_first_tokens'])}/{r['batch']}")
            lines.append(f"{r['context']:>6}{r['batch']:>3} {name:9}{s['prefill_s']:>10.2f}"
                         f"{s['prefill_tok_s']:>8.0f}{s['prefill_over_roofline']:>7.1f}x"
                         f"{s['step_ms']:>9.2f}{s['decode_tok_s']:>8.0f}"
                         f"{s['step_over_roofline']:>7.1f}x  {same}")
        lines.append(f"{'':>10}jlco/llama.cpp: prefill {r['prefill_speedup']:.2f}x, decode "
                     f"{r['decode_speedup']:.2f}x (roofline {r['roofline_prefill_s']:.3f} s, "
                     f"{r['roofline_step_ms']:.2f} ms)")
    return "\n".join(lines)


def plot(out: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["batch"] for r in out["results"]})
    fig, axes = plt.subplots(len(batches), 3, figsize=(13, 3.2 * len(batches)), squeeze=False)
    for row, b in zip(axes, batches):
        rs = sorted((r for r in out["results"] if r["batch"] == b), key=lambda r: r["context"])
        ctx = [r["context"] for r in rs]
        for ax, key, label in ((row[0], "prefill_tok_s", "prefill tokens/s"),
                               (row[1], "decode_tok_s", "decode tokens/s")):
            for name, color in (("jlco", "C0"), ("llamacpp", "C1")):
                ax.plot(ctx, [r[name][key] for r in rs], "o-", color=color,
                        label="llama.cpp" if name == "llamacpp" else name)
            ax.set_ylabel(f"{label}, batch {b}")
        # jlco ÷ llama.cpp beside the bars (1.0×; 1.5× for batch 4 and 16K+ decode)
        ax = row[2]
        for key, color, label in (("prefill_speedup", "C2", "prefill"),
                                  ("decode_speedup", "C3", "decode")):
            ax.plot(ctx, [r[key] for r in rs], "o-", color=color, label=label)
        for bar in (1.0, 1.5):
            ax.axhline(bar, color="grey", lw=0.8, ls="--")
        ax.set_ylabel(f"jlco ÷ llama.cpp, batch {b}")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv) -> None:
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    if FLAGS.child:
        return measure_child(FLAGS.child)
    if FLAGS.merge:
        return _write(merge(FLAGS.merge))
    contexts, batches = _ints("contexts", FLAGS.contexts), _ints("batches", FLAGS.batches)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        cli.fail(PROG, "llama-cpp-python is not installed: pip install -e '.[llamacpp]'")
    from jlco.config import apply_overrides, load_config
    from jlco.planning import probe, roofline
    cfg = load_config(ROOT / FLAGS.config)
    try:   # a bad override fails before the slow setup
        jlco_cfg = apply_overrides(cfg, FLAGS.override)   # the rooflines count its cache
    except ValueError as e:
        cli.fail(PROG, str(e))
    results = []
    with tempfile.TemporaryDirectory() as d:
        ckpt, gguf = (os.path.join(d, MODEL_FILES[n]) for n in ("jlco", "llamacpp"))
        write_checkpoint(cfg, ckpt)
        convert(ckpt, gguf)
        print("measuring the machine ...", file=sys.stderr)
        m = probe.measure(os.path.getsize(gguf))   # the weights a step streams
        m["mem_gbps"] = FLAGS.mem_gbps or m["mem_gbps"]
        m["peak_gflops"] = FLAGS.peak_gflops or m["peak_gflops"]
        machine = roofline.cpu_machine(m["mem_gbps"], m["peak_gflops"])
        for context in contexts:
            for batch in batches:
                print(f"context {context}, batch {batch} ...", file=sys.stderr)
                results.append(setting(d, jlco_cfg, machine, context, batch))
    out = dict(config=FLAGS.config, overrides=FLAGS.override, new_tokens=FLAGS.new_tokens,
               rounds=FLAGS.rounds, kv_type=FLAGS.kv_type, jlco_as=FLAGS.jlco_as, results=results,
               machine=dict(m, platform=platform.platform(), cpus=os.cpu_count(),
                            cpu=_cpu_model()))
    _write(out)


def _runs(out: dict) -> list[tuple[list[int], dict]]:
    """Merged runs: (their contexts, their machine reading), in order."""
    runs = []
    for r in out["results"]:
        m = r["machine"]
        if not runs or runs[-1][1] != m:
            runs.append(([], m))
        if r["context"] not in runs[-1][0]:
            runs[-1][0].append(r["context"])
    return runs


def merge(paths: list[str]) -> dict:
    """Earlier runs' JSON → one report: every setting keeps its own run's machine
    reading (its rooflines came from it); runs must share the config and KV type."""
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(pathlib.Path(p).read_text()))
        except (OSError, ValueError) as e:
            cli.fail(PROG, f"--merge: cannot read {p}: {e}")
        if "machine" not in runs[-1] or "results" not in runs[-1]:
            cli.fail(PROG, f"--merge: {p} is not one run's JSON (no machine/results)")
    for key in ("config", "overrides", "kv_type", "new_tokens"):
        if len({json.dumps(r.get(key)) for r in runs}) > 1:
            cli.fail(PROG, f"--merge: the runs differ in {key!r}: "
                           f"{[r.get(key) for r in runs]}")
    results = [dict(r, machine=run["machine"]) for run in runs for r in run["results"]]
    return dict(config=runs[0]["config"], overrides=runs[0]["overrides"],
                new_tokens=runs[0]["new_tokens"], rounds=[run["rounds"] for run in runs],
                kv_type=runs[0]["kv_type"], merged_from=list(paths), results=results)


def _write(out: dict) -> None:
    dest = pathlib.Path(FLAGS.out)
    dest.mkdir(parents=True, exist_ok=True)
    plot(out, dest / "vs_llamacpp.png")
    cli.write_report(dest / "vs_llamacpp.json", out,
                     table(out) + f"\nwrote {dest / 'vs_llamacpp.json'}", FLAGS.json)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
