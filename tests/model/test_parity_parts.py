"""Per-part parity with transformers' DeepseekV32 modules (fp32, tiny config): RMSNorm,
both RoPE layouts, indexer top-k (as sets), MLA, MoE routing and output, one block.

Inputs are captured with forward hooks on one reference forward pass over a prompt
longer than index_topk, then fed to our modules. Tolerances: fp32 different-order
sums; measured errors are ~1e-6, asserted at 1e-4 of the output magnitude.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tests.support.hf_reference import build_hf_model, capture, hf_tensors, t2n
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

from jlco.checkpoint.hf_names import model_from_hf
from jlco.config import load_config
from jlco.model import kv_cache
from jlco.model.layers import (
    apply_rope_half,
    apply_rope_interleaved,
    rope_cos_sin,
    rope_frequencies,
)

CFG = load_config("configs/tiny.py")
SEQ = 48          # > index_topk (32)
MOE_LAYER = 1


def _close(got, want, rel=1e-4):
    """f32 (jnp) vs transformers' torch f32: the same math summed in a different order;
    measured errors are ~1e-6 of the output magnitude, so an absolute budget of
    rel * max|want| (1e-4 by default; callers pass 1e-6 / 1e-5 for elementwise parts)
    covers it without depending on the size of each element."""
    want = np.asarray(want)
    chex.assert_trees_all_close(np.asarray(got), want, atol=rel * float(np.abs(want).max()),
                                rtol=0)


@pytest.fixture(scope="module")
def setup():
    ref = build_hf_model(CFG.model, seed=2, init_std=0.1, bias_std=0.05)
    ours = model_from_hf(CFG.model, hf_tensors(ref), mtp=False)
    store, hooks = {}, []
    layer = ref.model.layers[MOE_LAYER]
    for key, mod in (("block", layer), ("attn", layer.self_attn), ("indexer", layer.self_attn.indexer),
                     ("gate", layer.mlp.gate), ("moe", layer.mlp), ("rope", ref.model.rotary_emb)):
        hooks.append(capture(mod, store, key))
    ids = torch.tensor(np.random.RandomState(3).randint(0, CFG.model.vocab_size, (1, SEQ)))
    with torch.no_grad():
        ref(ids)
    for h in hooks:
        h.remove()
    return ref, ours, store


def _fresh():
    pos = jnp.arange(SEQ, dtype=jnp.int32)[None]
    cos, sin = rope_cos_sin(CFG.model, pos)
    return kv_cache.init_cache(CFG, 1, 64), pos, jnp.array([SEQ], jnp.int32), cos, sin


def test_rmsnorm(setup):
    ref, ours, _ = setup
    x = torch.randn(3, 5, CFG.model.hidden_size)
    with torch.no_grad():
        want = t2n(ref.model.norm(x))
    _close(ours.norm(jnp.asarray(x.numpy())), want, 1e-6)


def test_rope_frequencies_and_layouts(setup):
    ref, _, store = setup
    inv_freq, att = rope_frequencies(CFG.model)
    # base ** (-2i / r) in jnp f32 vs torch f32: pow may round differently by an ulp or so
    chex.assert_trees_all_close(np.asarray(inv_freq), t2n(ref.model.rotary_emb.inv_freq),
                                rtol=1e-6, atol=0)
    assert att == pytest.approx(ref.model.rotary_emb.attention_scaling)
    cos_hf, sin_hf = store["rope"][2]
    cos, sin = rope_cos_sin(CFG.model, jnp.arange(SEQ)[None])
    r = CFG.model.qk_rope_head_dim
    # cos of f32 angles up to SEQ rad computed by XLA vs torch: |cos| <= 1, so 1e-6 absolute
    # is a few f32 ulps (rtol 1e-7 as numpy's default had it).
    chex.assert_trees_all_close(np.asarray(cos), t2n(cos_hf)[..., :r // 2], rtol=1e-7, atol=1e-6)
    q = torch.randn(1, 2, SEQ, r)       # [b, heads, s, r] as transformers lays it out
    k = torch.randn(1, 1, SEQ, r)
    qi, ki = hf.apply_rotary_pos_emb_interleave(q, k, cos_hf, sin_hf)
    qh, kh = hf.apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    cb, sb = cos[:, None], sin[:, None]  # add the head axis
    for fn, q_want, k_want in ((apply_rope_interleaved, qi, ki), (apply_rope_half, qh, kh)):
        _close(fn(jnp.asarray(q.numpy()), cb, sb), t2n(q_want), 1e-6)
        _close(fn(jnp.asarray(k.numpy()), cb, sb), t2n(k_want), 1e-6)
    with pytest.raises(AssertionError):   # the two layouts really differ
        chex.assert_trees_all_close(t2n(qi), t2n(qh), rtol=1e-5, atol=1e-3)


def test_indexer_topk_sets(setup):
    _, ours, store = setup
    args, kwargs, want = store["indexer"]
    x, qr = (jnp.asarray(t2n(a)) for a in args[:2])
    cache, pos, lengths, cos, sin = _fresh()
    got, _ = ours.layers[MOE_LAYER].self_attn.indexer(x, qr, cos, sin, cache, MOE_LAYER, pos,
                                                      lengths, "xla")
    chex.assert_shape(got, (1, SEQ, CFG.model.index_topk))   # [b, s, topk]
    chex.assert_type(got, jnp.int32)
    got, want = np.asarray(got)[0], t2n(want).astype(np.int64)[0]
    topk = CFG.model.index_topk
    for t in range(SEQ):
        ours_set = set(got[t][got[t] >= 0].tolist())
        ref_set = set(w for w in want[t].tolist() if w <= t)   # drop its causal-masked picks
        assert ours_set == ref_set, f"query {t}"
        assert len(ours_set) == min(t + 1, topk)


def test_mla_output(setup):
    _, ours, store = setup
    args, kwargs, want = store["attn"]
    x = jnp.asarray(t2n(kwargs["hidden_states"]))
    cache, pos, lengths, cos, sin = _fresh()
    got, cache, _ = ours.layers[MOE_LAYER].self_attn(x, cos, sin, cache, MOE_LAYER, pos, lengths,
                                                     "xla")
    chex.assert_shape(got, (1, SEQ, CFG.model.hidden_size))   # [b, s, hidden]
    chex.assert_type(got, jnp.float32)
    _close(got, t2n(want[0]))


def test_moe_routing_and_output(setup):
    _, ours, store = setup
    (x_hf,), _, (_, w_want, ids_want) = store["gate"]
    w, ids = ours.layers[MOE_LAYER].mlp.gate(jnp.asarray(t2n(x_hf)).reshape(-1, CFG.model.hidden_size))
    order_got, order_want = np.argsort(np.asarray(ids), 1), np.argsort(t2n(ids_want), 1)
    chex.assert_trees_all_equal(np.take_along_axis(np.asarray(ids), order_got, 1),
                                np.take_along_axis(t2n(ids_want).astype(np.int64), order_want, 1))
    _close(np.take_along_axis(np.asarray(w), order_got, 1),
           np.take_along_axis(t2n(w_want), order_want, 1), 1e-5)
    (x_moe,), _, y_want = store["moe"]
    _close(ours.layers[MOE_LAYER].mlp(jnp.asarray(t2n(x_moe))), t2n(y_want))


def test_one_block(setup):
    _, ours, store = setup
    args, kwargs, want = store["block"]
    x = jnp.asarray(t2n(args[0]))
    cache, pos, lengths, cos, sin = _fresh()
    got, _, _ = ours.layers[MOE_LAYER](x, cos, sin, cache, MOE_LAYER, pos, lengths, "xla")
    _close(got, t2n(want if isinstance(want, torch.Tensor) else want[0]))
