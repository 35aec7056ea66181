"""Long-context parity: jlco against `transformers` at 8K-128K positions, step by step.

One random DeepseekV32 checkpoint saved by `transformers` (`jlco.checkpoint.hf_reference.
long_context_model`: hidden 512, 4 layers, index_topk 256, f32; or --checkpoint) is read
by both engines. Per --lengths, one seeded random prompt:
  reference  `transformers` in f32, the prompt fed in --hf_chunk-token pieces through its
             cache, then greedy decode; forward hooks on its indexer modules keep each
             layer's top-k set and score row of the last query (cached in --ref_cache:
             16K takes minutes on 2 cores);
  jlco       the model's chunked prefill (--jlco_chunk) and decode steps, fed the
             reference's tokens (teacher forcing, so every step compares the same
             context), each layer's top-k set read from the cache's `record` and its
             score row computed from the layer's own indexer projections.
Reported per step: |Δ log-prob| of the reference's token (and the max over the vocab),
the reference's top-2 logit margin, whether jlco's argmax is the same token; per layer:
rows in one top-k set and not the other, each engine's gap between its k-th and
(k+1)-th score, the largest score difference between the engines, and where the sets
differ how far the differing rows sit from the k-th score in float64 (a tie when that is
within f32 rounding, ~1e-6 of the scores).
Writes parity_long.json and parity_long.png (|Δ log-prob| per step, one line a length).

  python tools/parity_long.py --lengths=16384 --out=out/parity_long
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import pickle
import sys
import tempfile
import time

import numpy as np
from absl import flags

from jlco.util import cli

PROG = "parity_long"
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_list("lengths", ["8192", "16384", "32768"], "prompt lengths (tokens)")
    flags.DEFINE_integer("steps", 16, "greedy steps compared (step 0 = the prefill's token)",
                         lower_bound=1)
    flags.DEFINE_string("checkpoint", None, "a transformers DeepseekV32 checkpoint directory "
                        "(default: build a random one, long_context_model())")
    flags.DEFINE_integer("seed", 0, "weights seed of the built checkpoint")
    flags.DEFINE_integer("layers", 4, "layers of the built checkpoint (1: no cascade of "
                         "prompt-query top-k ties through later layers' keys)", lower_bound=1)
    flags.DEFINE_float("init_std", 0.1, "weight std of the built checkpoint (0.02 gives flat "
                       "logits: greedy margins of ~1e-2)")
    flags.DEFINE_float("bias_std", 0.05, "router correction-bias std of the built checkpoint")
    flags.DEFINE_integer("prompt_seed", 0, "seed of the random prompt")
    flags.DEFINE_integer("hf_chunk", 128, "prompt tokens per transformers forward", lower_bound=1)
    flags.DEFINE_integer("jlco_chunk", 512, "prompt tokens per jlco prefill chunk", lower_bound=1)
    flags.DEFINE_string("ref_cache", "/tmp/parity_long_ref", "directory caching reference runs")
    flags.DEFINE_string("out", "out/parity_long", "directory for the JSON and PNG")
    flags.DEFINE_bool("json", False, "print the JSON to stdout (the table to stderr)")


def progress(msg: str) -> None:
    print(f"[{PROG}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- reference (transformers)

def reference(hf_model, tag: str, prompt: np.ndarray) -> list[dict]:
    """The reference records for `prompt`, from --ref_cache when present."""
    from jlco.checkpoint.hf_reference import hf_greedy_chunked
    path = pathlib.Path(FLAGS.ref_cache) / (
        f"{tag}_L{len(prompt)}_p{FLAGS.prompt_seed}_s{FLAGS.steps}_c{FLAGS.hf_chunk}.pkl")
    if path.exists():
        saved = pickle.loads(path.read_bytes())
        if np.array_equal(saved["prompt"], prompt):
            progress(f"reference {len(prompt)}: cached {path}")
            return saved["records"]
    t = time.perf_counter()
    last = [0.0]

    def report(msg):
        if time.perf_counter() - last[0] > 20:
            last[0] = time.perf_counter()
            progress(msg)
    recs = hf_greedy_chunked(hf_model(), prompt, FLAGS.steps, FLAGS.hf_chunk, progress=report)
    progress(f"reference {len(prompt)}: {time.perf_counter() - t:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(dict(prompt=prompt, records=recs)))
    return recs


# ---------------------------------------------------------------- jlco

def _score_row(q, w, keys, pos):
    """Indexer scores [t] of one query: q [H, D], w [H] (scales folded), keys [t, D];
    −inf past position `pos` (f32, HIGHEST precision as the reference scorer)."""
    import jax
    import jax.numpy as jnp
    logits = jnp.einsum("hd,td->ht", q.astype(jnp.float32), keys.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    s = jnp.einsum("ht,h->t", jnp.maximum(logits, 0.0), w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.arange(keys.shape[0]) <= pos, s, -jnp.inf)


@functools.lru_cache(maxsize=None)
def _traced_step():
    """A jitted step of the model's own layers that also returns, for the last real
    query, each layer's indexer score row [L, t] (the layer's `pre` projections against
    the keys the layer just wrote)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jlco.model import kv_cache

    @functools.partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
    def step(graphdef, state, cache, tokens, n_new, *, impl="xla"):
        model = nnx.merge(graphdef, state)
        x, cos, sin, positions, kl = model.inputs(tokens, cache)
        last = n_new[0] - 1
        rows = []
        for i, layer in enumerate(model.layers):
            _, _, iq, _, iw = layer.pre(x, cos, sin)
            x, cache = layer(x, cos, sin, cache, i, positions, kl, impl)
            keys, _ = kv_cache.index_keys(cache, i)
            rows.append(_score_row(iq[0, last], iw[0, last], keys[0], positions[0, last]))
        h, cache = model.finish(x, cache, n_new)
        logits = model.logits(h[0, last])
        return (jax.nn.log_softmax(logits), jnp.stack(rows),
                dataclasses.replace(cache, scan_len=None))
    return step


def _run_piece(split_model, cache, piece: np.ndarray, n_new: int, topk: int):
    """One prefill chunk or decode step → (log-softmax [V], score rows [L, t] of the last
    real query, top-k sets [L, n_new, k] of its real queries, cache)."""
    import jax.numpy as jnp
    from jlco.model.kv_cache import scan_bucket
    n_layers = len(cache.index_k)
    seen = int(np.asarray(cache.lengths)[0]) + n_new
    cache = dataclasses.replace(
        cache, scan_len=scan_bucket(seen, cache.max_len),
        record=jnp.full((n_layers, 1, piece.shape[1], topk), -1, jnp.int32))
    logp, rows, cache = _traced_step()(*split_model, cache, jnp.asarray(piece),
                                       jnp.asarray([n_new], jnp.int32))
    sets = np.asarray(cache.record)[:, 0, :n_new]
    return np.asarray(logp), np.asarray(rows), sets, dataclasses.replace(cache, record=None)


def jlco_run(cfg, split_model, prompt: np.ndarray, forced: list[int]) -> list[dict]:
    """jlco's prefill of `prompt`, then decode steps fed `forced` (the reference's tokens)."""
    from jlco.model import kv_cache
    topk, chunk, n = cfg.model.index_topk, FLAGS.jlco_chunk, len(prompt)
    cache = kv_cache.init_cache(cfg, batch=1, max_len=n + len(forced) + 1)
    t, prompt_sets = time.perf_counter(), []
    for lo in range(0, n, chunk):
        piece = np.zeros((1, chunk), np.int32)
        width = min(chunk, n - lo)
        piece[0, :width] = prompt[lo:lo + width]
        logp, rows, sets, cache = _run_piece(split_model, cache, piece, width, topk)
        prompt_sets.append(np.sort(sets, axis=-1))
    progress(f"jlco prefill {n}: {time.perf_counter() - t:.0f} s")
    out = [dict(logp=logp, rows=rows, sets=sets[:, -1],
                prompt_sets=np.concatenate(prompt_sets, axis=1))]          # [L, n, k]
    for tok in forced[:-1]:
        logp, rows, sets, cache = _run_piece(split_model, cache, np.array([[tok]], np.int32),
                                             1, topk)
        out.append(dict(logp=logp, rows=rows, sets=sets[:, -1]))
    return out


def prompt_flips(ref_sets: list, our_sets: np.ndarray, k: int) -> list[dict]:
    """Per layer, the prompt queries (positions >= k, where the indexer selects) whose
    top-k sets differ between the engines: count and first positions."""
    out = []
    for layer, ref in enumerate(ref_sets):
        ours = our_sets[layer]
        differ = np.nonzero((ref[k:] != ours[k:len(ref)]).any(-1))[0] + k
        out.append(dict(layer=layer, n_queries=len(differ), first=differ[:12].tolist()))
    return out


def explain_layer0(hf_model, prompt, ref_sets, our_sets, k: int, n: int = 4) -> list[dict]:
    """The first `n` layer-0 prompt queries whose sets differ, scored in float64 from
    transformers' own layer-0 indexer (its inputs are the embeddings, the same in both
    engines up to rounding): the k-th and (k+1)-th scores and the swapped rows'."""
    from jlco.checkpoint.hf_reference import layer0_index_scores64
    flips = prompt_flips(ref_sets[:1], our_sets[:1], k)[0]["first"][:n]
    out = []
    for t, row in zip(flips, layer0_index_scores64(hf_model(), prompt, flips)):
        srt = np.sort(row[:t + 1])[::-1]
        r, o = set(ref_sets[0][t].tolist()), set(our_sets[0][t].tolist())
        out.append(dict(query=t, kth=float(srt[k - 1]), kth1=float(srt[k]),
                        gap=float(srt[k - 1] - srt[k]),
                        only_ref={int(i): float(row[i]) for i in sorted(r - o)},
                        only_jlco={int(i): float(row[i]) for i in sorted(o - r)}))
    return out


# ---------------------------------------------------------------- comparison

def compare_layer(ref: dict, ours_row: np.ndarray, ours_set: np.ndarray, k: int) -> dict:
    """Top-k sets and score rows of one layer at one step, both engines."""
    r32, r64 = ref["scores"].astype(np.float64), ref["scores64"]
    mine = ours_row[:len(r32)].astype(np.float64)
    ref_set, our_set = set(ref["topk"].tolist()), set(int(i) for i in ours_set if i >= 0)
    only_ref, only_ours = sorted(ref_set - our_set), sorted(our_set - ref_set)
    kth64 = np.sort(r64)[::-1][k - 1]
    diff_rows = only_ref + only_ours

    def gap(row):
        s = np.sort(row[np.isfinite(row)])[::-1]
        return float(s[k - 1] - s[k]) if len(s) > k else float("inf")
    finite = np.isfinite(r32) & np.isfinite(mine)
    return dict(
        only_ref=only_ref[:8], only_jlco=only_ours[:8], n_diff=len(only_ref),
        ref_gap=gap(r32), jlco_gap=gap(mine),
        max_score_diff=float(np.abs(mine[finite] - r32[finite]).max()),
        ref_err64=float(np.abs(r32[finite] - r64[finite]).max()),
        jlco_err64=float(np.abs(mine[finite] - r64[finite]).max()),
        score_scale=float(np.abs(r64[finite]).max()),
        diff_rows_from_kth64=[float(r64[i] - kth64) for i in diff_rows[:8]])


def compare(refs: list[dict], ours: list[dict], k: int) -> list[dict]:
    steps = []
    for i, (r, o) in enumerate(zip(refs, ours)):
        tok = r["token"]
        steps.append(dict(
            step=i, ref_token=tok, jlco_argmax=int(np.argmax(o["logp"])),
            dlogp=float(abs(o["logp"][tok] - r["logp"][tok])),
            max_dlogp=float(np.abs(o["logp"] - r["logp"]).max()), ref_margin=r["margin"],
            layers=[compare_layer(rl, o["rows"][j], o["sets"][j], k)
                    for j, rl in enumerate(r["layers"])]))
    return steps


def table(out: dict) -> str:
    lines = []
    for run in out["runs"]:
        lines.append(f"length {run['length']}: max |dlogp| {run['max_dlogp']:.2e}, greedy "
                     f"agrees for {run['agree_steps']}/{len(run['steps'])} steps")
        flips = ", ".join(f"L{f['layer']} {f['n_queries']}" for f in run["prompt_flips"])
        lines.append(f"prompt queries whose top-k sets differ, per layer: {flips}")
        for tie in run["layer0_ties"]:
            lines.append(f"  layer 0 query {tie['query']}: f64 k-th {tie['kth']:.9g}, "
                         f"(k+1)-th {tie['kth1']:.9g} (gap {tie['gap']:.1e}); only ref "
                         f"{tie['only_ref']}, only jlco {tie['only_jlco']}")
        lines.append(f"{'step':>4}{'dlogp':>10}{'margin':>8}{'same':>5}  per layer: "
                     "rows differing / max|d score| / ref k-gap")
        for s in run["steps"]:
            per = "  ".join(f"{la['n_diff']}/{la['max_score_diff']:.1e}/{la['ref_gap']:.1e}"
                            for la in s["layers"])
            lines.append(f"{s['step']:>4}{s['dlogp']:>10.2e}{s['ref_margin']:>8.3f}"
                         f"{'y' if s['jlco_argmax'] == s['ref_token'] else 'N':>5}  {per}")
    return "\n".join(lines)


def plot(out: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in out["runs"]:
        ax.semilogy([s["step"] for s in run["steps"]],
                    [max(s["dlogp"], 1e-9) for s in run["steps"]], "o-",
                    label=f"{run['length']} tokens")
    ax.axhline(1e-4, color="C7", ls="--", lw=1, label="1e-4")
    ax.set_xlabel("greedy step (0 = prefill)")
    ax.set_ylabel("|jlco - transformers| log-prob")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main

def _models(ckpt: str, cfg):
    """(a lazy transformers model, jlco's split model) from the checkpoint directory."""
    from jlco.checkpoint.load import load_model
    from jlco.model import prefill
    _, model, _ = load_model(ckpt, {"dtype": "float32"}, progress=False)

    @functools.lru_cache(maxsize=1)
    def hf_model():
        import torch
        from transformers import DeepseekV32ForCausalLM
        return DeepseekV32ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return hf_model, prefill.split(model)


def run(ckpt: str, tag: str, lengths: list[int]) -> dict:
    from jlco.checkpoint.load import read_hf_config
    from jlco.config import Config
    mcfg = read_hf_config(ckpt, dtype="float32")
    cfg = Config(name=PROG, model=mcfg).replace(
        cache__kv_format="f32", engine__max_batch_size=1,
        engine__max_context_len=max(lengths) + FLAGS.steps + 1)
    hf_model, ours = _models(ckpt, cfg)
    runs = []
    for n in lengths:
        prompt = np.random.default_rng(FLAGS.prompt_seed).integers(0, mcfg.vocab_size, n)
        refs = reference(hf_model, tag, prompt)
        mine = jlco_run(cfg, ours, prompt.astype(np.int32), [r["token"] for r in refs])
        k = mcfg.index_topk
        steps = compare(refs, mine, k)
        same = [s["jlco_argmax"] == s["ref_token"] for s in steps]
        ref_sets, our_sets = refs[0]["prompt_sets"], mine[0]["prompt_sets"]
        runs.append(dict(length=n, steps=steps, max_dlogp=max(s["dlogp"] for s in steps),
                         agree_steps=same.index(False) if False in same else len(same),
                         prompt_flips=prompt_flips(ref_sets, our_sets, k),
                         layer0_ties=explain_layer0(hf_model, prompt, ref_sets, our_sets, k)))
        progress(f"length {n}: max |dlogp| {runs[-1]['max_dlogp']:.2e}")
    return dict(checkpoint=tag, prompt_seed=FLAGS.prompt_seed, hf_chunk=FLAGS.hf_chunk,
                jlco_chunk=FLAGS.jlco_chunk, steps=FLAGS.steps, runs=runs)


def main(argv) -> None:
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments: {argv[1:]}")
    try:
        lengths = [int(x) for x in FLAGS.lengths]
    except ValueError:
        cli.fail(PROG, f"--lengths must be integers; got {FLAGS.lengths}")
    with tempfile.TemporaryDirectory() as d:
        if FLAGS.checkpoint:
            ckpt = FLAGS.checkpoint
            tag = "ckpt_" + pathlib.Path(ckpt).resolve().name
        else:
            from jlco.checkpoint.hf_reference import build_hf_model, long_context_model
            layers = "" if FLAGS.layers == 4 else f"_l{FLAGS.layers}"
            ckpt = d
            tag = f"built_s{FLAGS.seed}_std{FLAGS.init_std}_b{FLAGS.bias_std}{layers}"
            mcfg = dataclasses.replace(long_context_model(), num_hidden_layers=FLAGS.layers,
                                       first_k_dense_replace=min(1, FLAGS.layers - 1))
            build_hf_model(mcfg, FLAGS.seed, FLAGS.init_std, FLAGS.bias_std).save_pretrained(d)
        out = run(ckpt, tag, lengths)
    dest = pathlib.Path(FLAGS.out)
    dest.mkdir(parents=True, exist_ok=True)
    plot(out, dest / "parity_long.png")
    cli.write_report(dest / "parity_long.json", out,
                     table(out) + f"\nwrote {dest / 'parity_long.json'}", FLAGS.json)


if __name__ == "__main__":
    define_flags()
    cli.run_main(main, flags_parser=cli.flags_parser(PROG))
