"""Whole-model parity with transformers' DeepseekV32ForCausalLM (fp32, tiny config).

Tolerance: both sides compute in fp32 with different summation orders (absorbed vs
expanded MLA, grouped vs per-expert MoE); measured max |Δlogit| ≈ 3e-6 for logits of
magnitude ~3, so 1e-4 × max|logit| (≈1e-4 relative) leaves a 30× margin while any real
numerics bug (wrong RoPE layout, scale, top-k set) moves logits by 1e-2 or more.
Prompts are shorter (20) and longer (48) than index_topk (32), so the sparsity selects.

transformers quirks (5.x), checked here or in test_parity_parts.py:
- index_topk is applied the same way in prefill and cached decode (per query, over its
  causal keys); in prefill it takes topk over all T keys, so a query t < topk also
  "selects" causally masked future positions, which the attention mask then removes —
  we pad with −1 instead. Same effective set (test_indexer_topk_sets filters them).
- its interleaved MLA RoPE returns the de-interleaved layout [evens | odds]; q·k is the
  same, we emit the same layout.
- it ignores the MTP layer (`model.layers.61.*` is dropped on load), so MTP has no
  reference: the MTP path is checked for cache self-consistency only.
- it warns when yarn factor ≠ max_position_embeddings / original_max_position_embeddings
  and uses the explicit factor, as we do.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tests.support.hf_reference import build_hf_model, hf_tensors, t2n
from tests.support.split_steps import decode_step

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import load_config
from jlco.model import kv_cache, prefill

CFG = load_config("configs/tiny.py")
PROMPT_LENS = (20, 48)
STEPS = 16
MAX_LEN = 128
CHUNK = CFG.engine.prefill_chunk


def _tol(ref: np.ndarray) -> float:
    """f32 vs transformers' torch f32, different summation order: 1e-4 * max|logit| is a
    30x margin over the measured ~3e-6 (module docstring); used with rtol=0."""
    return 1e-4 * float(np.abs(ref).max())


@pytest.fixture(scope="module")
def ref():
    return build_hf_model(CFG.model, seed=0, init_std=0.1, bias_std=0.05)


@pytest.fixture(scope="module")
def ours(ref):
    return prefill.split(model_from_hf(CFG.model, hf_tensors(ref), mtp=False))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(1)
    toks = np.zeros((2, max(PROMPT_LENS)), np.int32)
    for i, n in enumerate(PROMPT_LENS):
        toks[i, :n] = rng.randint(0, CFG.model.vocab_size, n)
    return toks


@pytest.fixture(scope="module")
def hf_generated(ref, prompts):
    """transformers' cached greedy decode, one prompt at a time (no padding involved)."""
    out = []
    for i, n in enumerate(PROMPT_LENS):
        with torch.no_grad():
            g = ref.generate(torch.tensor(prompts[i:i + 1, :n]), max_new_tokens=STEPS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        out.append((t2n(g.sequences[0, n:]).astype(np.int32),
                    np.stack([t2n(l[0]) for l in g.logits])))
    return out


@pytest.fixture(scope="module")
def our_generated(ours, prompts):
    """Ragged batched prefill + STEPS greedy decode steps → (tokens [2, STEPS], logits)."""
    g, s = ours
    cache = kv_cache.init_cache(CFG, 2, MAX_LEN)
    logits, _, cache = prefill.prefill(ours, cache, prompts, PROMPT_LENS, chunk=CHUNK, impl="xla")
    toks, all_logits = [], []
    for _ in range(STEPS):
        all_logits.append(np.asarray(logits))
        nxt = np.argmax(all_logits[-1], axis=-1).astype(np.int32)
        toks.append(nxt)
        step_logits, _, cache = decode_step(g, s, cache, jnp.asarray(nxt[:, None]),
                                                   impl="xla")
        chex.assert_shape(step_logits, (2, 1, CFG.model.vocab_size))   # [b, s, V]
        chex.assert_type(step_logits, jnp.float32)
        logits = step_logits[:, -1]
    return np.stack(toks, 1), np.stack(all_logits, 1), np.asarray(logits), cache


def test_full_sequence_logits_match(ref, ours, prompts):
    n = PROMPT_LENS[1]
    with torch.no_grad():
        want = t2n(ref(torch.tensor(prompts[1:2, :n])).logits)
    g, s = ours
    got, _, cache = decode_step(g, s, kv_cache.init_cache(CFG, 1, MAX_LEN),
                                       jnp.asarray(prompts[1:2, :n]), impl="xla")
    chex.assert_shape(got, (1, n, CFG.model.vocab_size))   # logits [b, s, V]
    chex.assert_type(got, jnp.float32)
    chex.assert_trees_all_close(np.asarray(got), want, atol=_tol(want), rtol=0)  # see _tol
    assert int(cache.lengths[0]) == n


def test_greedy_tokens_and_logits_match(hf_generated, our_generated):
    toks, logits, _, cache = our_generated
    for i, (want_toks, want_logits) in enumerate(hf_generated):
        # chex takes no err_msg: the dict key names the request in its failure message
        chex.assert_trees_all_equal({f"request {i}": toks[i]}, {f"request {i}": want_toks})
        chex.assert_trees_all_close({f"request {i}": logits[i]}, {f"request {i}": want_logits},
                                    atol=_tol(want_logits), rtol=0)   # see _tol
    chex.assert_trees_all_equal(np.asarray(cache.lengths), np.array(PROMPT_LENS) + STEPS)


def test_decode_equals_full_recompute(ours, prompts, our_generated):
    """Logits after STEPS cached decode steps == a fresh prefill of the whole sequence."""
    toks, _, last_logits, _ = our_generated
    full = np.zeros((2, max(PROMPT_LENS) + STEPS), np.int32)
    lens = []
    for i, n in enumerate(PROMPT_LENS):
        full[i, :n + STEPS] = np.concatenate([prompts[i, :n], toks[i]])
        lens.append(n + STEPS)
    logits, _, _ = prefill.prefill(ours, kv_cache.init_cache(CFG, 2, MAX_LEN), full, lens,
                                  chunk=CHUNK, impl="xla")
    # our own f32 model both sides, but cached decode (one query per step, absorbed
    # attention over the cache) vs one prefill: different summation order; same budget as
    # the transformers comparison (see _tol).
    chex.assert_trees_all_close(np.asarray(logits), last_logits, atol=_tol(last_logits), rtol=0)


def test_chunked_prefill_equals_single_chunk(ours, prompts):
    single, h1, c1 = prefill.prefill(ours, kv_cache.init_cache(CFG, 2, MAX_LEN), prompts,
                                    PROMPT_LENS, chunk=CHUNK, impl="xla")
    chunked, h2, c2 = prefill.prefill(ours, kv_cache.init_cache(CFG, 2, MAX_LEN), prompts,
                                     PROMPT_LENS, chunk=16, impl="xla")
    # same f32 model and inputs, chunk 16 vs CHUNK: only the matmul row blocking and the
    # attention split across chunk boundaries change the summation order; logits are ~3,
    # so 1e-5 absolute is a few tens of f32 ulps.
    chex.assert_trees_all_close(np.asarray(chunked), np.asarray(single), atol=1e-5, rtol=0)
    chex.assert_trees_all_equal(np.asarray(c1.lengths), np.asarray(c2.lengths))
    for i, n in enumerate(PROMPT_LENS):   # f32 rows: equal up to matmul rounding
        rows1, rows2 = (np.stack([np.asarray(x[i, :n]) for x in c.latent]).view(np.float32)
                        for c in (c1, c2))
        # O(1) latent rows (RMS-normed projections) from differently blocked f32 matmuls
        chex.assert_trees_all_close(rows2, rows1, atol=1e-5, rtol=0)
