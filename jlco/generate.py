"""`python -m jlco.generate`: generate tokens for one prompt or a batch of prompts.

Prompts (exactly one of): --prompt_ids 1,2,3; --prompt "text" (a checkpoint with
tokenizer.json); --prompts_file FILE, JSON lines, each a list of token ids or
{"prompt": "text"}; --random_prompt N, N random token ids (seeded by --seed: a prompt
longer than the model's index_topk, so the sparse attention selects and, offloaded, rows
really move host→device). All prompts are decoded together as one batch.

Model: --checkpoint loads a Hugging Face directory or a jlco Orbax directory (from
`python -m jlco.convert`); a HF deepseek_v4 directory runs DeepSeek-V4
(`jlco.engine.v4_runner`: MTP drafts and the prefix cache off; --mesh expert/tensor
axes only; --offload puts its CSA entries in host memory, "offload" then holds the
prefetch health numbers per layer, as for MLA, and "csa_entries" their totals).
The compute dtype is --dtype when given, else the checkpoint's own (config.json
`dtype` / `torch_dtype`; an Orbax checkpoint's converted dtype), else bfloat16; stderr
says which and why. Without a checkpoint a small RANDOM-WEIGHT model is built and stderr
says so: the --config's own model when its random weights are small,
else configs/tiny.py's model section with the config's engine context and cache settings.

Engine: --config (default configs/tiny.py) gives the cache and engine sections. Without
--config the context follows the request (longest prompt + --max_new_tokens, rounded up
to a power of two, at most the model's max_position_embeddings) and the batch is the
number of prompts; an explicit --config's context is kept, and its larger max_batch_size
too when its own model runs; without --config the prefill chunk also takes the longest
prompt in one piece (up to 2,048 positions, `prefill_chunk_for`). --offload puts the MLA
latent cache in host memory (same tokens as without it). --mesh data=D,expert=E,tensor=T
(fields left out are 1; default: the config's `mesh` section) runs on a JAX mesh of
D·E·T devices (`jlco.parallel`): the parameters are placed by their logical axes and the
engine runs under the mesh, the routed experts split over E devices and the heads / MLP
/ vocabulary dimensions over T (same tokens as one device); with D > 1 attention runs
data-parallel, the batch slots, their caches and the host pool split over the D data
ranks (--mesh rounds the batch up to a multiple of D).

Several processes (hosts): --coordinator_address HOST:PORT --num_processes N
--process_id I (or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
--num_processes auto: SLURM, Open MPI, Cloud TPU, Kubernetes) join N processes running
the same command into one device set (`jlco.parallel.distributed`), and --mesh counts the
devices of all of them. Process 0 prints the output and the stderr report; the others
print only errors.

Output: one line of tokens per prompt, or --json: {"tokens", "logprobs", "timing"} for
--prompt_ids/--prompt, {"results": [{"tokens", "logprobs"}, ...], "timing"} for
--prompts_file, and with the cache offloaded "offload": the prefetch health numbers per
layer and summed (`OffloadMetrics.health`: rows_needed, rows_hit, rows_prefetched_used,
rows_prefetched_unused, rows_on_demand, h2d_bytes, d2h_bytes, fetch_wait_s) and the
admission warm-up's warmup_rows; strict JSON (a non-finite log-prob is an error, exit
1). Bad input is one `jlco.generate: error: ...` line on stderr, exit 2, no traceback (a
number outside a flag's bounds is absl's parse error, exit 1). Timing: prefill_s is
admission + prefill (with the prefill's compilation, prefill_compile_s of it), compile_s
the seconds the decode loop spent tracing, lowering and compiling (JAX's own events, all
in its first step: late_compiles counts programs compiled after it), decode_s the decode
loop without them. JAX's persistent compilation cache is on (`jlco.util.compile_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any

from absl import app, flags, logging

from jlco.parallel import distributed
from jlco.sampling.params import SamplingParams
from jlco.util import cli, compile_cache
from jlco.util.buckets import pow2_bucket

FLAGS = flags.FLAGS
PROG = "jlco.generate"
DTYPES = ("float32", "bfloat16", "float16")
MIN_CONTEXT = 64                   # smallest context bucket (fewer distinct compiled shapes)
PREFILL_CHUNK_MAX = 2048           # without --config: prompt positions per prefill piece at most
PREFILL_SCORES_BYTES = 1 << 30     # ... and one piece's f32 attention scores at most


class NonFiniteOutput(RuntimeError):
    """The model produced a NaN/Inf log-prob: the output is unusable (exit 1)."""


def define_flags() -> None:
    """Flags are defined only when this module runs as a program, so importing it
    (tests, other tools) never collides with another CLI's flag names."""
    flags.DEFINE_string("checkpoint", None, "HF or Orbax checkpoint directory (none: random tiny model)")
    flags.DEFINE_string("config", None, "config file for the cache/engine sections (and the model "
                        "when no checkpoint is given); default configs/tiny.py")
    flags.DEFINE_string("prompt_ids", None, "comma-separated prompt token ids, e.g. 1,2,3")
    flags.DEFINE_integer("random_prompt", None, "a prompt of this many random token ids "
                         "(seeded by --seed)", lower_bound=1)
    flags.DEFINE_string("prompt", None, "prompt text (needs a checkpoint with tokenizer.json)")
    flags.DEFINE_string("prompts_file", None, "JSON lines, one prompt each: a list of token ids "
                        "or {\"prompt\": \"text\"}; all are decoded as one batch")
    flags.DEFINE_integer("max_new_tokens", 16, "tokens to generate per prompt", lower_bound=1)
    flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 = greedy", lower_bound=0.0)
    flags.DEFINE_integer("seed", 0, "random seed (sampling: prompt i uses seed + i; and the "
                         "random model's weights)", lower_bound=0)
    flags.DEFINE_bool("offload", None, "latent cache in host memory (default: the config's value)")
    flags.DEFINE_enum("impl", None, ["auto", "xla", "pallas", "interpret"],
                      "attention kernels (default: config; interpret = Pallas interpret mode)")
    flags.DEFINE_integer("num_draft_tokens", 0, "MTP draft tokens per step (needs an MTP layer)",
                         lower_bound=0, upper_bound=7)
    flags.DEFINE_enum("dtype", None, list(DTYPES), "compute dtype (default: the checkpoint's "
                      "config.json dtype, else bfloat16; random model: its config's)")
    flags.DEFINE_bool("verify_checkpoint", True, "check an Orbax checkpoint's leaves against "
                      "the sha256 sums recorded at conversion (--noverify_checkpoint skips)")
    flags.DEFINE_string("mesh", None, "device mesh, e.g. expert=4 or data=1,expert=2,tensor=1 "
                        "(fields left out are 1; default: the config's mesh section)")
    flags.DEFINE_bool("json", False, "print JSON: {\"tokens\", \"logprobs\", \"timing\"} "
                      "(--prompts_file: {\"results\": [...], \"timing\"})")
    distributed.define_flags()


_quiet = False     # a process other than 0 of a multi-process job prints nothing


def _say(msg: str) -> None:
    if not _quiet:
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass
class Prompt:
    """One prompt as given: token ids, or text to tokenize; `label` names its source
    in error messages (a flag, or FILE:LINE)."""
    label: str
    ids: list[int] | None = None
    text: str | None = None
    random_len: int | None = None


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def read_prompts_file(path: str) -> list[Prompt]:
    """Prompts of a JSON-lines file (blank lines skipped); a bad line is a ValueError
    naming FILE:LINE and what is allowed."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"--prompts_file={path!r}: no such file")
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        label = f"{path}:{n}"
        try:
            v = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{label}: not valid JSON ({err})") from None
        if _is_token_list(v):
            out.append(Prompt(label, ids=v))
        elif isinstance(v, dict) and set(v) == {"prompt"} and isinstance(v["prompt"], str) \
                and v["prompt"]:
            out.append(Prompt(label, text=v["prompt"]))
        else:
            raise ValueError(f"{label}: {line.strip()[:80]!r} is invalid: allowed a non-empty "
                             "list of token ids or {\"prompt\": \"non-empty text\"}")
    if not out:
        raise ValueError(f"--prompts_file={path!r} holds no prompts")
    return out


def _prompts_from_flags() -> list[Prompt]:
    """The prompts as given, checked before any model is loaded, so a bad flag or file
    fails in a second."""
    names = ("prompt_ids", "prompt", "prompts_file", "random_prompt")
    given = [f"--{n}" for n in names if FLAGS[n].value is not None]
    if len(given) != 1:
        got = f" (got {' and '.join(given)})" if given else ""
        raise ValueError("give exactly one of --prompt_ids, --prompt, --prompts_file or "
                         f"--random_prompt{got}")
    if FLAGS.random_prompt is not None:
        return [Prompt("--random_prompt", random_len=FLAGS.random_prompt)]
    if FLAGS.prompts_file is not None:
        return read_prompts_file(FLAGS.prompts_file)
    if FLAGS.prompt is not None:
        if not FLAGS.prompt:
            raise ValueError("--prompt='' is invalid: allowed non-empty text")
        return [Prompt("--prompt", text=FLAGS.prompt)]
    try:
        ids = [int(t) for t in FLAGS.prompt_ids.split(",") if t.strip()]
    except ValueError:
        ids = []
    if not ids:
        raise ValueError(f"--prompt_ids={FLAGS.prompt_ids!r} is invalid: allowed "
                         "comma-separated integers, e.g. 1,2,3")
    return [Prompt("--prompt_ids", ids=ids)]


def _tokenize(prompts: list[Prompt], tokenizer_path, vocab: int) -> list[list[int]]:
    """Token ids of every prompt (text via the checkpoint's tokenizer.json), each id in
    the model's vocabulary."""
    tok = None
    out = []
    for p in prompts:
        ids = p.ids
        if p.random_len is not None:
            import numpy as np
            ids = np.random.default_rng(FLAGS.seed).integers(0, vocab, p.random_len).tolist()
        elif ids is None:
            if tokenizer_path is None:
                raise ValueError(f"{p.label}: text prompts need a checkpoint with "
                                 "tokenizer.json; give token ids instead")
            if tok is None:
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(tokenizer_path))
            ids = tok.encode(p.text).ids
            if not ids:
                raise ValueError(f"{p.label}: the prompt text encodes to no tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{p.label}: token id {bad[0]} is invalid: allowed 0..{vocab - 1} "
                             "(the model's vocab_size)")
        out.append(list(ids))
    return out


# ----------------------------------------------------------------------------- model


# ----------------------------------------------------------------------------- engine


def engine_shape(model, engine, lens: list[int], max_new: int, explicit: bool,
                 own_model: bool) -> dict:
    """Config overrides sizing `engine` (an EngineConfig) for these prompts on `model`
    (see the module docstring). A request longer than the model allows is a ValueError
    naming max_position_embeddings."""
    mpe = model.max_position_embeddings
    need = max(lens) + max_new
    if need > mpe:
        raise ValueError(f"the longest prompt ({max(lens)} tokens) + --max_new_tokens "
                         f"({max_new}) = {need} exceeds the model's max_position_embeddings "
                         f"({mpe})")
    if explicit:
        ctx = max(need, engine.max_context_len)
        if ctx > mpe:
            raise ValueError(f"engine.max_context_len={ctx} (from --config {FLAGS.config}) is "
                             f"invalid: allowed <= the model's max_position_embeddings ({mpe}); "
                             "omit --config to size the context from the request")
    else:
        ctx = pow2_bucket(need, MIN_CONTEXT, mpe)
    batch = len(lens)
    if explicit and own_model:
        batch = max(batch, engine.max_batch_size)
    shape = dict(engine__max_context_len=ctx, engine__max_batch_size=batch)
    if not explicit:
        shape["engine__prefill_chunk"] = prefill_chunk_for(model, engine.prefill_chunk,
                                                           max(lens), ctx)
    return shape


def prefill_chunk_for(model, chunk: int, longest: int, ctx: int) -> int:
    """Without --config: the prefill chunk that takes the longest prompt in one piece, up
    to PREFILL_CHUNK_MAX positions and while one chunk's attention scores (f32, every
    head, [chunk, context]) stay within PREFILL_SCORES_BYTES; never below `chunk` (the
    config's). The tiny config's 64 ran a 2,048-token prompt as 32 pieces."""
    want = pow2_bucket(longest, 1, min(PREFILL_CHUNK_MAX, ctx))
    while want > chunk and model.num_attention_heads * want * ctx * 4 > PREFILL_SCORES_BYTES:
        want //= 2
    return max(chunk, want)


def _timing(step_s: list[float], prefill_s: float, loop_s: float, decode_tokens: int, *,
            compile_s: float, prefill_compile_s: float, late_compiles: int) -> dict:
    """compile_s: seconds the decode loop spent tracing, lowering and compiling (JAX's
    own events; all of it in the first step: `late_compiles` counts programs compiled
    after it). decode_s: the decode loop without them. prefill_s includes the prefill's
    compilation, prefill_compile_s says how much it was."""
    steps = list(step_s)
    p50 = statistics.median(steps) if steps else None
    decode_s = max(0.0, loop_s - compile_s)
    return {"compile_s": round(compile_s, 4), "prefill_s": round(prefill_s, 4),
            "prefill_compile_s": round(prefill_compile_s, 4),
            "decode_s": round(decode_s, 4),
            "decode_tokens_per_s": (round(decode_tokens / decode_s, 2)
                                    if steps and decode_s > 0 else None),
            "step_ms_p50": round(p50 * 1e3, 3) if steps else None,
            "late_compiles": late_compiles}


def _decode(engine, prompts: list[list[int]], clock):
    """Submit every prompt, admit + prefill them (timed), then decode to the end (timed;
    `clock`, a CompileClock, says how much of each was tracing and compiling)."""
    reqs = [engine.submit(p, FLAGS.max_new_tokens,
                          SamplingParams(temperature=FLAGS.temperature, seed=FLAGS.seed + i))
            for i, p in enumerate(prompts)]
    c0 = clock.total
    t0 = time.perf_counter()
    engine.admit()
    prefill_s = time.perf_counter() - t0
    prefill_compile_s = clock.total - c0
    first = sum(len(r.tokens) for r in reqs)
    c1 = clock.total
    t1 = time.perf_counter()
    more = engine.step()          # the first decode step: its programs compile here
    after_first = clock.compiles
    while more:
        more = engine.step()
    loop_s = time.perf_counter() - t1
    decoded = sum(len(r.tokens) for r in reqs) - first
    return reqs, _timing(engine.step_seconds, prefill_s, loop_s, decoded,
                         compile_s=clock.total - c1, prefill_compile_s=prefill_compile_s,
                         late_compiles=clock.compiles - after_first)


# ----------------------------------------------------------------------------- output


def check_finite(results: list[dict]) -> None:
    """A NaN/Inf log-prob means the model computed garbage: NonFiniteOutput naming it."""
    for i, r in enumerate(results):
        for j, lp in enumerate(r["logprobs"]):
            if not math.isfinite(lp):
                raise NonFiniteOutput(f"log-prob of generated token {j} (id {r['tokens'][j]}) "
                                      f"of prompt {i} is {lp}: the model produced non-finite "
                                      "values (bad weights?)")


def render(results: list[dict], timing: dict, as_json: bool, batch_form: bool,
           extra: dict | None = None) -> str:
    """stdout text: tokens per line, or strict JSON (json.dumps(allow_nan=False)) with
    `extra`'s keys beside "timing" ("offload": the prefetch health numbers)."""
    check_finite(results)
    if not as_json:
        return "\n".join(" ".join(map(str, r["tokens"])) for r in results)
    doc = ({"results": results, "timing": timing} if batch_form
           else {**results[0], "timing": timing})
    return json.dumps({**doc, **(extra or {})}, allow_nan=False)


def _report(engine, timing: dict) -> None:
    _say(f"timing: prefill {timing['prefill_s']:.3f} s (of it compiling "
         f"{timing['prefill_compile_s']:.3f} s), decode {timing['decode_s']:.3f} s "
         f"({timing['decode_tokens_per_s']} tok/s, p50 step {timing['step_ms_p50']} ms), "
         f"compile (first decode step) {timing['compile_s']:.3f} s, "
         f"{timing['late_compiles']} program(s) compiled after it")
    if engine.spec_metrics is not None:
        m = engine.spec_metrics
        _say(f"speculative: {FLAGS.num_draft_tokens} drafts/step, {m.steps} steps, "
             f"drafted {m.drafted}, accepted {m.accepted} (acceptance "
             f"{m.acceptance_rate:.3f}), {m.mean_accepted_tokens:.2f} tokens/step")
    if engine.metrics is not None:
        snap = engine.metrics.snapshot()["total"]
        _say(f"offload: hit rate {snap['hit_rate']:.3f}, H2D {snap['h2d_bytes']} B, "
             f"warm-up rows {engine.runner.warmup_rows}")


# ----------------------------------------------------------------------------- main


def _prepare():
    """Everything that can fail on bad input, cheapest first: (cfg, model, prompts)."""
    from jlco.config import load_config
    from jlco.launch import load
    prompts = _prompts_from_flags()
    explicit = FLAGS.config is not None
    base = load_config(FLAGS.config or load.TINY_CONFIG)
    choice = load.choose_model(FLAGS.checkpoint, base, FLAGS.dtype, FLAGS.seed)
    name = (FLAGS.checkpoint and pathlib.Path(FLAGS.checkpoint).name) or base.name
    ids = _tokenize(prompts, choice.tokenizer_path, choice.model.vocab_size)
    shape = engine_shape(choice.model, base.engine, [len(p) for p in ids],
                         FLAGS.max_new_tokens, explicit, choice.own_model)
    offload = base.cache.offload if FLAGS.offload is None else FLAGS.offload
    over = dict(shape, cache__offload=offload, engine__num_draft_tokens=FLAGS.num_draft_tokens,
                **({"engine__attention_impl": FLAGS.impl} if FLAGS.impl else {}),
                **({} if FLAGS.mesh is None else parse_mesh(FLAGS.mesh)))
    if choice.model.model_type == "deepseek_v4":
        over["cache__prefix_cache"] = False   # V4's state is not paged (Config._check_v4)
    ranks = over.get("mesh__data", 1)      # data ranks split the slots evenly
    over["engine__max_batch_size"] = -(-over["engine__max_batch_size"] // ranks) * ranks
    checked = base.replace(model=choice.model, name=name, **over)   # before any weight
    mesh = load.checked_mesh(checked)
    _say(choice.banner)
    cfg, model = load.load_sharded(choice, checked, mesh, seed=FLAGS.seed,
                                   verify=FLAGS.verify_checkpoint)
    _say(f"engine: {len(ids)} prompt(s), batch {cfg.engine.max_batch_size}, context "
         f"{cfg.engine.max_context_len}, offload {'on' if cfg.cache.offload else 'off'}"
         + ("" if mesh is None else f", mesh {dict(mesh.shape)}"))
    return cfg, model, ids, mesh


def parse_mesh(text: str) -> dict:
    """--mesh 'data=D,expert=E,tensor=T' → config overrides (fields left out are 1), read
    as every CLI reads --mesh (`jlco.planning.mesh`)."""
    from jlco.planning.mesh import mesh_overrides
    return mesh_overrides(text)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    compile_cache.enable()
    global _quiet
    with cli.errors_exit(PROG, ValueError, OSError):
        if distributed.multi_process_asked(FLAGS.num_processes):   # fail before joining
            _prompts_from_flags()
            if FLAGS.mesh is not None:
                parse_mesh(FLAGS.mesh)
        info = distributed.initialize_from_flags(FLAGS)   # before any jax backend exists
    if info is not None:
        _say(f"distributed: {info.describe()}")
        _quiet = not info.is_lead
    engine = None
    with cli.interruptible(PROG):
        try:
            with cli.errors_exit(PROG, ValueError, OSError, NotImplementedError):
                cfg, model, prompts, mesh = _prepare()
                import jax

                from jlco.engine.core import Engine
                from jlco.util.compile_clock import CompileClock
                clock = CompileClock()
                with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                    engine = Engine(cfg, model)
                    _say(engine.step_kind.describe())
                    reqs, timing = _decode(engine, prompts, clock)
            results = [{"tokens": list(r.tokens), "logprobs": [float(x) for x in r.logprobs]}
                       for r in reqs]
            extra = {}
            if engine.metrics is not None:      # the prefetch scheduler's health numbers
                extra["offload"] = dict(engine.metrics.health(),
                                        warmup_rows=engine.runner.warmup_rows)
            v4_stats = getattr(engine.runner, "entry_stats", lambda: None)()
            if v4_stats is not None:            # deepseek_v4: the offloaded CSA entries
                extra["offload"]["csa_entries"] = v4_stats
            with cli.errors_exit(PROG, NonFiniteOutput, code=cli.FAILURE_EXIT):
                text = render(results, timing, FLAGS.json, FLAGS.prompts_file is not None,
                              extra)
            if not _quiet:
                print(text)
            _report(engine, timing)
        finally:
            if engine is not None:
                engine.close()   # the host pool (a "file" pool deletes its file)
    distributed.shutdown()       # after a success only: wait for the job's other processes


if __name__ == "__main__":
    define_flags()
    cli.run_main(main)
