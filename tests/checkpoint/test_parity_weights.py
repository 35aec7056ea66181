"""HF tensor names ↔ model, cache byte layouts, sampling, and the MTP draft path."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests.support.split_steps import decode_step

from jlco.checkpoint.hf_names import hf_tensor_names, model_from_hf
from jlco.config import load_config
from jlco.model import kv_cache, prefill

CFG = load_config("configs/tiny.py")
M = CFG.model
L = M.num_hidden_layers


def _random_tensors(mtp: bool) -> dict:
    rng = np.random.RandomState(0)
    return {k: (0.1 * rng.randn(*s)).astype(np.float32)
            for k, s in hf_tensor_names(M, mtp).items()}


@pytest.fixture(scope="module")
def mtp_model():
    return prefill.split(model_from_hf(M, _random_tensors(True), mtp=True))


def test_names_cover_checkpoint_layout():
    names = hf_tensor_names(M, True)
    assert names["model.layers.1.mlp.experts.7.down_proj.weight"] == (M.hidden_size,
                                                                       M.moe_intermediate_size)
    assert names["lm_head.weight"] == (M.vocab_size, M.hidden_size)
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "mlp.gate.e_score_correction_bias",
                   "self_attn.indexer.k_norm.bias"):
        assert f"model.layers.{L}.{suffix}" in names
    assert not any(k.startswith(f"model.layers.{L}.") for k in hf_tensor_names(M, False))
    assert "model.layers.0.mlp.gate_proj.weight" in names            # first layer dense


@pytest.mark.parametrize("mutate, match", [
    (lambda t: t.pop("model.layers.2.self_attn.indexer.wk.weight"), "missing tensor .*indexer.wk"),
    (lambda t: t.__setitem__("model.layers.0.bogus.weight", np.zeros(1)), "unknown tensor .*bogus"),
    (lambda t: t.__setitem__("model.norm.weight", np.zeros(3, np.float32)),
     "model.norm.weight.*shape"),
])
def test_bad_tensors_raise_naming_the_tensor(mutate, match):
    t = _random_tensors(False)
    mutate(t)
    with pytest.raises(ValueError, match=match):
        model_from_hf(M, t, mtp=False)


def test_loaded_values_and_layout():
    t = _random_tensors(True)
    t[f"model.layers.{L}.embed_tokens.weight"] = t["model.embed_tokens.weight"]  # released ckpt
    m = model_from_hf(M, t, mtp=True)
    chex.assert_trees_all_equal(np.asarray(m.layers[2].mlp.experts.up_proj[...][5]),
                                t["model.layers.2.mlp.experts.5.up_proj.weight"].T)
    chex.assert_trees_all_equal(np.asarray(m.mtp.eh_proj.weight[...]),
                                t[f"model.layers.{L}.eh_proj.weight"].T)
    assert m.layers[1].self_attn.indexer.weights_proj.weight[...].dtype == jnp.float32


@pytest.mark.parametrize("fmt, dtype, exact", [("f32", jnp.float32, True),
                                              ("bf16", jnp.bfloat16, True),
                                              ("fp8", None, False)])
def test_latent_rows_roundtrip(fmt, dtype, exact):
    cfg = CFG.replace(cache__kv_format=fmt)
    cache = kv_cache.init_cache(cfg, 2, 8)
    assert all(x.dtype == jnp.uint8 and x.shape[-1] == cfg.row_bytes for x in cache.latent)
    rows = jnp.asarray(np.random.RandomState(1).randn(2, 2, M.latent_dim).astype(np.float32))
    pos = jnp.array([[3, 4], [0, 7]], jnp.int32)
    cache = kv_cache.write_latent(cache, 1, rows, pos)
    sel = jnp.array([[[4, 3, -1]], [[7, 0, -1]]], jnp.int32)
    got = kv_cache.latent_for_attention(cache, 1, sel)
    kv, ids = got[-2], got[-1]
    chex.assert_trees_all_equal(np.asarray(ids), np.asarray([[[4, 3, -1]], [[15, 8, -1]]]))
    from jlco.model.attention import decode_rows, kernel_rows
    vals = np.asarray(decode_rows(kernel_rows(kv, fmt), fmt, M.qk_rope_head_dim))
    want = np.asarray(rows) if dtype is None else np.asarray(rows.astype(dtype).astype(jnp.float32))
    got_rows = vals[[4, 3, 15, 8]]
    want_rows = want[[0, 0, 1, 1], [1, 0, 1, 0]]
    if exact:
        chex.assert_trees_all_equal(got_rows, want_rows)
    else:   # e4m3 nope part: ≤ 2^-4 relative of the block max; bf16 rope part
        # (2^-9 relative); 0.07 * max|row| covers 2^-4 of a block max that is at most the row
        # max, with margin; rtol 1e-7 as numpy's default had it.
        chex.assert_trees_all_close(got_rows, want_rows, rtol=1e-7,
                                    atol=0.07 * np.abs(want_rows).max())


def test_sample_greedy_and_logprobs():
    logits = jnp.asarray(np.random.RandomState(2).randn(3, 50).astype(np.float32))
    tok, lp = prefill.sample(logits, 0.0, jax.random.key(0))
    chex.assert_trees_all_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    want = np.asarray(jax.nn.log_softmax(logits))[np.arange(3), np.asarray(tok)]
    # both f32 log-softmax of the same logits, possibly fused/reduced differently: rtol 1e-6
    # is a few f32 ulps on log-probs of magnitude ~1-4
    chex.assert_trees_all_close(np.asarray(lp), want, rtol=1e-6, atol=0)
    peaked = logits.at[:, 7].set(100.0)
    tok_t, _ = prefill.sample(peaked, jnp.array([1.0, 0.5, 0.0]), jax.random.key(1))
    chex.assert_trees_all_equal(np.asarray(tok_t), np.full(3, 7))
    draws = {int(prefill.sample(logits[:1], 5.0, jax.random.key(i))[0][0]) for i in range(20)}
    assert len(draws) > 3                                 # temperature really samples


def test_mtp_draft_cached_equals_full(mtp_model):
    """MTP draft logits for a whole span at once == the same span fed one token at a time
    (the MTP layer's own cache rows serve the later tokens)."""
    g, s = mtp_model
    toks = np.random.RandomState(5).randint(0, M.vocab_size, (1, 41)).astype(np.int32)
    cache = kv_cache.init_cache(CFG, 1, 64)
    _, hid, cache = decode_step(g, s, cache, jnp.asarray(toks[:, :40]), impl="xla")
    full, _, _ = prefill.mtp_step(g, s, jax.tree.map(jnp.copy, cache), hid, jnp.asarray(toks[:, 1:41]),
                                 jnp.array([0], jnp.int32), impl="xla")
    _, _, c2 = prefill.mtp_step(g, s, cache, hid[:, :39], jnp.asarray(toks[:, 1:40]),
                               jnp.array([0], jnp.int32), impl="xla")
    last, _, _ = prefill.mtp_step(g, s, c2, hid[:, 39:40], jnp.asarray(toks[:, 40:41]),
                                 jnp.array([39], jnp.int32), impl="xla")
    chex.assert_shape(full, (1, 40, M.vocab_size))   # MTP draft logits [b, s, V]
    chex.assert_type(full, jnp.float32)
    # same f32 MTP layer: the last token against its cached rows vs inside the 40-token
    # span, so attention and matmuls sum in a different order; 1e-4 absolute on O(1)
    # logits (rtol 1e-7 as numpy's default had it).
    chex.assert_trees_all_close(np.asarray(last[:, 0]), np.asarray(full[:, 39]), rtol=1e-7,
                                atol=1e-4)
