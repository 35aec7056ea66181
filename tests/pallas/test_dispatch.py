"""Kernel dispatch: impl="interpret" (interpret-mode kernel on CPU) == impl="xla" within
summation-order tolerance; impl="auto" on CPU is the XLA reference bit for bit; bad impl and
impl="pallas" without a kernel fail clearly; lowering picks Triton for cuda and Mosaic for
tpu at DeepSeek-V3.2 shapes; tuning lookups fall back in the documented order."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.pallas import dispatch, tuning
from jlco.pallas.fp8_rows import quantize_kv_rows

CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _indexer_inputs(key_format, *, b=2, s_q=2, h=16, d=32, length=160):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((b, s_q, h, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, s_q, h)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, length, d)), jnp.float32)
    lengths = jnp.asarray([length, 37][:b], jnp.int32)
    if key_format == "fp8":
        k = jax.lax.bitcast_convert_type(keys.astype(jnp.float8_e4m3fn), jnp.uint8)
        return (q, w, k, lengths), jnp.asarray(rng.uniform(0.5, 2.0, (b, length)), jnp.float32)
    return (q, w, keys, lengths), None


def _mla_inputs(kv_format, *, b=2, s_q=2, h=16, d_nope=128, d_rope=64, n=96, topk=24):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((b, s_q, h, d_nope + d_rope)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((n, d_nope + d_rope)), jnp.float32)
    kv = quantize_kv_rows(rows, d_rope=d_rope) if kv_format == "fp8" else rows
    idx = rng.permutation(n)[: b * s_q * topk].reshape(b, s_q, topk).astype(np.int32)
    idx[0, 0, topk // 2:] = -1
    idx[1, 1, :] = -1
    return q, kv, jnp.asarray(idx)


@pytest.mark.parametrize("key_format", ["bf16", "fp8"])
def test_indexer_interpret_equals_xla_on_cpu(key_format):
    args, scale = _indexer_inputs(key_format)
    got = dispatch.indexer_topk(*args, 48, k_scale=scale, key_format=key_format,
                                impl="interpret")
    want = dispatch.indexer_topk(*args, 48, k_scale=scale, key_format=key_format, impl="xla")
    chex.assert_shape([got[0], got[1]], (2, 2, 48))   # indices, scores: [b, s_q, topk]
    chex.assert_type([got[0], got[1]], [jnp.int32, jnp.float32])
    idx, ridx = np.asarray(got[0]), np.asarray(want[0])
    for b in range(idx.shape[0]):
        for t in range(idx.shape[1]):
            assert set(idx[b, t].tolist()) == set(ridx[b, t].tolist())
    # interpret-mode kernel vs the XLA path: same f32 math (fp8 keys decode exactly), summed
    # in a different order over head and key tiles; 2e-5 is a few hundred f32 ulps on O(1)
    # scores.
    chex.assert_trees_all_close(np.asarray(got[1]), np.asarray(want[1]), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_format", ["f32", "fp8"])
def test_sparse_mla_interpret_equals_xla_on_cpu(kv_format):
    q, kv, idx = _mla_inputs(kv_format)
    out, lse = dispatch.sparse_mla(q, kv, idx, 0.07, kv_format=kv_format, d_rope=64,
                                   impl="interpret")
    rout, rlse = dispatch.sparse_mla(q, kv, idx, 0.07, kv_format=kv_format, d_rope=64,
                                     impl="xla")
    chex.assert_shape(out, (2, 2, 16, 128))   # [b, s_q, h, d_v]
    chex.assert_shape(lse, (2, 2, 16))        # [b, s_q, h]
    chex.assert_type([out, lse], jnp.float32)
    # interpret-mode kernel vs the XLA path, both f32 (fp8 rows dequantise exactly): the
    # kernel's online softmax rescales its running sum block by block, the XLA path
    # normalises once; out (a weighted sum of O(1) rows, accumulated through the rescaling)
    # gets 1e-4, lse (one log of the final sum) 1e-5.
    chex.assert_trees_all_close(np.asarray(out), np.asarray(rout), rtol=1e-4, atol=1e-4)
    chex.assert_trees_all_close(np.asarray(lse), np.asarray(rlse), rtol=1e-5, atol=1e-5)
    assert np.isposinf(np.asarray(lse[1, 1])).all()    # no valid row -> lse +inf


def test_bad_impl_names_allowed_values():
    args, _ = _indexer_inputs("bf16")
    with pytest.raises(ValueError, match=r"impl='triton'.*'auto', 'xla', 'pallas'"):
        dispatch.indexer_topk(*args, 8, impl="triton")
    q, kv, idx = _mla_inputs("f32")
    with pytest.raises(ValueError, match="impl="):
        dispatch.sparse_mla(q, kv, idx, 0.1, kv_format="f32", d_rope=64, impl="fast")


def test_pallas_impl_without_kernel_fails_clearly_on_cpu():
    args, _ = _indexer_inputs("bf16")
    with pytest.raises(ValueError, match="no Pallas kernel for platform cpu.*impl=.interpret."):
        dispatch.indexer_topk(*args, 8, impl="pallas")
    q, kv, idx = _mla_inputs("f32")
    with pytest.raises(ValueError, match="no Pallas kernel for platform cpu"):
        dispatch.sparse_mla(q, kv, idx, 0.1, kv_format="f32", d_rope=64, impl="pallas")


def _lower_indexer(platform, impl, s_q=1, key_format="fp8"):
    b, h, d, length = 2, 64, 128, 131072
    kdt = jnp.uint8 if key_format == "fp8" else jnp.bfloat16
    sds = jax.ShapeDtypeStruct
    scale = sds((b, length), jnp.float32) if key_format == "fp8" else None
    f = lambda q, w, k, lens, sc: dispatch.indexer_topk(      # noqa: E731
        q, w, k, lens, 2048, k_scale=sc, key_format=key_format, impl=impl)
    return jax.jit(f).trace(
        sds((b, s_q, h, d), jnp.bfloat16), sds((b, s_q, h), jnp.float32),
        sds((b, length, d), kdt), sds((b,), jnp.int32), scale,
    ).lower(lowering_platforms=(platform,)).as_text()


def _lower_mla(platform, impl, s_q=1, kv_format="fp8"):
    b, h, topk, n = 2, 128, 2048, 2 * 131072
    row = jax.ShapeDtypeStruct((n, 656), jnp.uint8) if kv_format == "fp8" else \
        jax.ShapeDtypeStruct((n, 576), jnp.bfloat16)
    f = lambda q, kv, idx: dispatch.sparse_mla(               # noqa: E731
        q, kv, idx, 0.1352, kv_format=kv_format, d_rope=64, impl=impl)
    return jax.jit(f).trace(
        jax.ShapeDtypeStruct((b, s_q, h, 576), jnp.bfloat16), row,
        jax.ShapeDtypeStruct((b, s_q, topk), jnp.int32),
    ).lower(lowering_platforms=(platform,)).as_text()


def test_auto_is_the_xla_reference_on_cpu():
    """The CPU serving path never runs a kernel in interpret mode: auto == xla exactly,
    and its program holds no interpret-mode grid loop (a while loop)."""
    args, scale = _indexer_inputs("fp8")
    kw = dict(k_scale=scale, key_format="fp8")
    chex.assert_trees_all_equal(dispatch.indexer_topk(*args, 48, **kw),
                                dispatch.indexer_topk(*args, 48, **kw, impl="xla"))
    q, kv, idx = _mla_inputs("fp8")
    kw = dict(kv_format="fp8", d_rope=64)
    chex.assert_trees_all_equal(dispatch.sparse_mla(q, kv, idx, 0.07, **kw),
                                dispatch.sparse_mla(q, kv, idx, 0.07, **kw, impl="xla"))
    for impl, loops in (("auto", False), ("interpret", True)):
        hlo = jax.jit(lambda q, kv, idx: dispatch.sparse_mla(  # noqa: B023
            q, kv, idx, 0.07, **kw, impl=impl)).lower(q, kv, idx).compile().as_text()
        assert (" while(" in hlo) == loops, impl


@pytest.mark.parametrize("impl", ["auto", "pallas", "interpret"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("op", ["indexer", "sparse_mla"])
def test_dispatch_lowers_to_platform_kernel(op, platform, impl):
    lower = _lower_indexer if op == "indexer" else _lower_mla
    text = lower(platform, impl, s_q=2)
    other = CUSTOM_CALL["tpu" if platform == "cuda" else "cuda"]
    assert CUSTOM_CALL[platform] in text and other not in text


@pytest.mark.parametrize("op", ["indexer", "sparse_mla"])
def test_xla_impl_lowers_without_custom_kernels(op):
    text = (_lower_indexer if op == "indexer" else _lower_mla)("cuda", "xla", s_q=1)
    assert all(c not in text for c in CUSTOM_CALL.values())


def test_tuning_lookup_falls_back_in_order():
    h200_long = tuning.lookup("indexer", platform="cuda", dtype="fp8",
                              device_kind="NVIDIA H200", context=131072)
    assert h200_long == tuning.TABLE[("NVIDIA H200", "indexer", "fp8", "long")]
    # Short context on an H200 has no entry of its own: the cuda platform row applies.
    h200_short = tuning.lookup("indexer", platform="cuda", dtype="fp8",
                               device_kind="NVIDIA H200", context=4096)
    assert h200_short == {**tuning.DEFAULTS["indexer"],
                          **tuning.TABLE[("cuda", "indexer", "*", "*")]}
    # Lowering for tpu from this CPU machine resolves to the tpu platform row.
    assert tuning.lookup("indexer", platform="tpu", dtype="bf16")["block_n"] == \
        tuning.TABLE[("tpu", "indexer", "*", "*")]["block_n"]
    with pytest.raises(ValueError, match="kernel"):
        tuning.lookup("matmul", platform="cuda", dtype="bf16")
    with pytest.raises(ValueError, match="platform"):
        tuning.lookup("indexer", platform="rocm", dtype="bf16")


def test_fit_block_h_respects_head_count_and_triton_minimum():
    assert dispatch._fit_block_h(64, 128, "cuda") == 64
    assert dispatch._fit_block_h(64, 48, "cuda") == 16
    assert dispatch._fit_block_h(64, 8, "cuda") is None   # kernel pads heads itself
    assert dispatch._fit_block_h(64, 8, "cpu") == 8
    assert dispatch._fit_block_h(128, 24, "tpu") == 8
