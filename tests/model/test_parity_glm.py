"""GLM-5 (`glm_moe_dsa`) parity with transformers' GlmMoeDsaForCausalLM (fp32, tiny shapes),
and proof that a layer sharing its top-k (IndexShare) runs no indexer.

The model is configs/tiny.py's shapes in GLM's form: 4 layers with indexer_types
full / shared / shared / full (the shared layers reuse layer 0's top-k) and MLP kinds
dense / sparse / dense / sparse (not a first_k_dense_replace prefix), one expert group
(GLM's n_group 1), plain RoPE, rms_norm_eps 1e-5 (GLM-5's; the latent norms keep 1e-6 as
transformers does). "all full" is the same with every layer running its indexer. Both
sides compute in f32; the tolerance is test_parity_model.py's (1e-4 x max|logit|, a 30x
margin over summation-order noise), and greedy tokens must be equal. Prompts of 20 and
48 tokens around index_topk 32, so the indexer (and the shared top-k) really select.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from tests.support.hf_reference import build_hf_model, hf_tensors, t2n
from tests.support.split_steps import decode_step

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import load_config
from jlco.model import kv_cache, prefill
from jlco.model.decoder import DeepseekV32

BASE = load_config("configs/tiny.py")
SHARED = ("full", "shared", "shared", "full")
GLM = dataclasses.replace(
    BASE.model, model_type="glm_moe_dsa", num_hidden_layers=4, n_group=1, topk_group=1,
    mlp_layer_types=("dense", "sparse", "dense", "sparse"), indexer_types=SHARED,
    rope_scaling=None, rms_norm_eps=1e-5, num_nextn_predict_layers=0)
# all_full also takes a large rms_norm_eps: the latent norms' fixed 1e-6 then matters
# beyond the tolerance (with 1e-5 it does not).
MODELS = {"index_share": GLM,
          "all_full": dataclasses.replace(GLM, indexer_types=None, rms_norm_eps=1e-2)}
PROMPT_LENS = (20, 48)
STEPS = 12
MAX_LEN = 128


def _tol(ref: np.ndarray) -> float:
    return 1e-4 * float(np.abs(ref).max())     # as test_parity_model._tol


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
    """(jlco config, transformers reference, our split model) per model variant."""
    m = MODELS[request.param]
    ref = build_hf_model(m, seed=0, init_std=0.1, bias_std=0.05)
    cfg = BASE.replace(model=m)
    return cfg, ref, prefill.split(model_from_hf(m, hf_tensors(ref), mtp=False))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(1)
    toks = np.zeros((2, max(PROMPT_LENS)), np.int32)
    for i, n in enumerate(PROMPT_LENS):
        toks[i, :n] = rng.randint(0, BASE.model.vocab_size, n)
    return toks


def _hf_generate(ref, prompts):
    out = []
    for i, n in enumerate(PROMPT_LENS):
        with torch.no_grad():
            g = ref.generate(torch.tensor(prompts[i:i + 1, :n]), max_new_tokens=STEPS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        out.append((t2n(g.sequences[0, n:]).astype(np.int32),
                    np.stack([t2n(x[0]) for x in g.logits])))
    return out


def test_reference_is_index_share():
    """The reference really shares: transformers built no indexer for layers 1 and 2."""
    ref = build_hf_model(GLM, seed=0)
    assert [layer.self_attn.indexer is None for layer in ref.model.layers] == \
        [t == "shared" for t in SHARED]


def test_full_sequence_logits_match(pair, prompts):
    cfg, ref, (g, s) = pair
    n = PROMPT_LENS[1]
    with torch.no_grad():
        want = t2n(ref(torch.tensor(prompts[1:2, :n])).logits)
    got, _, _ = decode_step(g, s, kv_cache.init_cache(cfg, 1, MAX_LEN),
                            jnp.asarray(prompts[1:2, :n]), impl="xla")
    chex.assert_trees_all_close(np.asarray(got), want, atol=_tol(want), rtol=0)


def test_greedy_tokens_and_logprobs_match(pair, prompts):
    """Ragged batched prefill (chunks of 16) + cached greedy decode == transformers'
    generate: the same tokens, and log-probs within 1e-4."""
    cfg, ref, (g, s) = pair
    cache = kv_cache.init_cache(cfg, 2, MAX_LEN)
    logits, _, cache = prefill.prefill((g, s), cache, prompts, PROMPT_LENS, chunk=16,
                                       impl="xla")
    toks, all_logits = [], []
    for _ in range(STEPS):
        all_logits.append(np.asarray(logits))
        toks.append(np.argmax(all_logits[-1], axis=-1).astype(np.int32))
        step, _, cache = decode_step(g, s, cache, jnp.asarray(toks[-1][:, None]), impl="xla")
        logits = step[:, -1]
    toks, all_logits = np.stack(toks, 1), np.stack(all_logits, 1)
    for i, (want_toks, want_logits) in enumerate(_hf_generate(ref, prompts)):
        chex.assert_trees_all_equal({f"request {i}": toks[i]}, {f"request {i}": want_toks})
        got_lp = jax.nn.log_softmax(all_logits[i], axis=-1)
        want_lp = jax.nn.log_softmax(want_logits, axis=-1)
        chex.assert_trees_all_close(np.asarray(got_lp), np.asarray(want_lp), atol=1e-4, rtol=0)


def test_shared_layers_have_no_indexer_and_no_keys():
    cfg = BASE.replace(model=GLM, cache__indexer_key_format="fp8")
    model = DeepseekV32(GLM, rngs=nnx.Rngs(0))
    cache = kv_cache.init_cache(cfg, 2, 64)
    for i, kind in enumerate(SHARED):
        has = model.layers[i].self_attn.indexer is not None
        assert has == (kind == "full"), i
        assert cache.index_k[i].size == (2 * 64 * GLM.index_head_dim if has else 0), i
        assert cache.index_scale[i].size == (2 * 64 if has else 0), i
    assert (cache.batch, cache.max_len) == (2, 64)


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in a jaxpr and every jaxpr nested in its params."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for p in eqn.params.values():
            for j in (p if isinstance(p, (tuple, list)) else (p,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    n += _count(inner, name)
    return n


def _step_top_ks(types) -> int:
    m = dataclasses.replace(GLM, mlp_layer_types=("dense",) * 4,
                            indexer_types=None if "shared" not in types else types)
    g, s = prefill.split(DeepseekV32(m, rngs=nnx.Rngs(0)))
    cache = kv_cache.init_cache(BASE.replace(model=m), 1, 64)

    def step(state, c, t):
        h, c = nnx.merge(g, state)(t, c, impl="xla")
        return h, c
    return _count(jax.make_jaxpr(step)(s, cache, jnp.zeros((1, 1), jnp.int32)).jaxpr, "top_k")


def test_only_full_layers_compute_an_indexer():
    """A decode step's program holds the indexer's top-k once per full layer and never
    for a shared one: with dense MLPs only (no router top_k), the step's top_k count is
    (full layers) x (top_k ops of one indexer)."""
    per_layer = _step_top_ks(("full",) * 4) // 4
    assert per_layer >= 1 and _step_top_ks(("full",) * 4) == 4 * per_layer
    for types in (SHARED, ("full", "shared", "full", "shared")):
        assert _step_top_ks(types) == types.count("full") * per_layer, types
