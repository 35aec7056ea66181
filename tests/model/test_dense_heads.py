"""A prefill chunk attends densely in one of two forms (`jlco.model.mla.MLA.dense`): in
latent space with absorbed queries (`attention.sparse_mla_dense`, then W_UV), or per
head over up-projected keys and values (`attention.mla_dense_heads`, the form
transformers computes). Both are the same masked softmax; the chunk's size picks the one
with fewer FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlco.config import load_config
from jlco.model import attention
from jlco.model.mla import MLA

CFG = load_config("configs/tiny.py").model


def _inputs(seed: int, b: int, s: int, t: int, k: int):
    c, r, h = CFG.kv_lora_rank, CFG.qk_rope_head_dim, CFG.num_attention_heads
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    mla = MLA(CFG, rngs=nnx.Rngs(seed))
    q_nope = jax.random.normal(keys[0], (b, s, h, CFG.qk_nope_head_dim), jnp.float32)
    q_rope = jax.random.normal(keys[1], (b, s, h, r), jnp.float32)
    rows = jax.random.normal(keys[2], (b, t, c + r), jnp.float32)
    pos = np.array(jax.random.randint(keys[3], (b, s, k), 0, t))
    pos[0, 0] = -1                  # a query that selected nothing: zeros out
    pos[-1, 1, : k // 2] = -1       # a query with padded selections
    return mla, q_nope, q_rope, rows, jnp.asarray(pos, jnp.int32)


@pytest.mark.parametrize("s", [8, 1024])    # one tile; DENSE_TILE_S tiles under lax.map
def test_heads_form_equals_latent_form(s):
    mla, q_nope, q_rope, rows, pos = _inputs(0, b=2, s=s, t=96, k=12)
    w_uk, w_uv = mla.kv_b_proj.w_uk[...], mla.kv_b_proj.w_uv[...]
    q_abs = jnp.einsum("bshn,hnc->bshc", q_nope, w_uk)
    scale = CFG.softmax_scale
    latent = attention.sparse_mla_dense(jnp.concatenate([q_abs, q_rope], -1), rows, pos,
                                        scale, kv_format="f32", d_rope=CFG.qk_rope_head_dim)
    want = jnp.einsum("bshc,hvc->bshv", latent, w_uv)
    got = attention.mla_dense_heads(q_nope, q_rope, rows, pos, w_uk, w_uv, scale,
                                    kv_format="f32", d_rope=CFG.qk_rope_head_dim)
    assert got.shape == want.shape == (2, s, CFG.num_attention_heads, CFG.v_head_dim)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[0, 0]), 0.0)


def test_chunk_size_picks_the_form_with_fewer_flops():
    # DeepSeek-V3.2: c 512, n 128, v 128 → break-even at 512·256 / 768 = 170.7 queries.
    assert not attention.heads_cheaper(170, 512, 128, 128)
    assert attention.heads_cheaper(171, 512, 128, 128)
    assert attention.heads_cheaper(512, 512, 128, 128)
    assert not attention.heads_cheaper(1, 512, 128, 128)


def test_mla_dense_uses_both_forms_with_one_result():
    mla, _, _, rows, _ = _inputs(1, b=1, s=4, t=64, k=8)
    d = CFG.hidden_size
    cos = jnp.ones((1, 1, CFG.qk_rope_head_dim // 2), jnp.float32)
    sin = jnp.zeros_like(cos)
    heads, latent = 0, 0

    @jax.jit                        # one program per chunk size, not ~150 op-by-op ones
    def both(x, pos):
        s = x.shape[1]
        cos_s, sin_s = (jnp.broadcast_to(a, (1, s, a.shape[-1])) for a in (cos, sin))
        hq = mla.head_queries(mla.q_a_layernorm(mla.q_a_proj(x)), cos_s, sin_s)
        q = mla.absorb(*hq)
        got = mla.dense(hq, rows, pos, "f32", x.dtype)
        want = mla.post(attention.sparse_mla_dense(q, rows, pos, CFG.softmax_scale,
                                                   kv_format="f32",
                                                   d_rope=CFG.qk_rope_head_dim), x.dtype)
        return got, want

    for s in (16, 256):             # below and above the break-even for the tiny shape
        x = jax.random.normal(jax.random.PRNGKey(s), (1, s, d), jnp.float32)
        pos = jax.random.randint(jax.random.PRNGKey(s + 1), (1, s, 8), 0, 64)
        got, want = both(x, pos)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        cheaper = attention.heads_cheaper(s, CFG.kv_lora_rank, CFG.qk_nope_head_dim,
                                          CFG.v_head_dim)
        heads, latent = heads + cheaper, latent + (not cheaper)
    assert heads == 1 and latent == 1, "the two chunk sizes should take different forms"
