"""`layers.Fused` / `decoder.fuse_projections` (what the runner does on one XLA:CPU device):
the projections that read one input run as one matmul, with the same outputs, and the
separate weights are dropped."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.config import load_config
from jlco.model.decoder import DeepseekV32, fuse_projections
from jlco.model.layers import rope_cos_sin
from jlco.model.mla import MLA
from jlco.model.moe import MLP

CFG = load_config("configs/tiny.py").model


def _x(d, s=3):
    return jax.random.normal(jax.random.PRNGKey(7), (2, s, d), jnp.float32)


def test_fused_mla_projections_equal_the_separate_ones():
    mla = MLA(CFG, rngs=nnx.Rngs(3))
    assert mla.indexer is not None
    fused = nnx.clone(mla)
    assert fused.fuse() and not fused.fuse()
    assert fused.q_a_proj is None and fused.q_b_proj is None and fused.indexer.wk is None
    x = _x(CFG.hidden_size)
    cos, sin = rope_cos_sin(CFG, jnp.arange(3)[None].repeat(2, 0))
    ref, out = mla.projections(x, cos, sin), fused.projections(x, cos, sin)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_fused_mla_without_indexer():
    mla = MLA(CFG, rngs=nnx.Rngs(4))
    mla.indexer = None                 # a layer that shares its top-k (IndexShare)
    fused = nnx.clone(mla)
    fused.fuse()
    x = _x(CFG.hidden_size)
    cos, sin = rope_cos_sin(CFG, jnp.arange(3)[None].repeat(2, 0))
    ref, out = mla.projections(x, cos, sin), fused.projections(x, cos, sin)
    assert out[2:] == (None, None, None)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(out), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_fused_mlp_equals_the_separate_one():
    mlp = MLP(CFG.hidden_size, 96, dtype=jnp.float32, rngs=nnx.Rngs(5))
    fused = nnx.clone(mlp)
    assert fused.fuse()
    assert fused.gate_proj is None and fused.gate_up.sizes == (96, 96)
    x = _x(CFG.hidden_size)
    np.testing.assert_allclose(fused(x), mlp(x), rtol=1e-5, atol=1e-6)


def test_fuse_projections_walks_the_model_once():
    model = DeepseekV32(CFG, rngs=nnx.Rngs(0))
    n = fuse_projections(model)
    mlas = [m for _, m in nnx.iter_graph(model) if isinstance(m, MLA)]
    assert n > len(mlas) > 0 and all(m.x_proj is not None for m in mlas)
    assert fuse_projections(model) == 0
