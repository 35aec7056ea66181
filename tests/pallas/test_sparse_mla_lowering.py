"""Sparse MLA decode at DeepSeek-V3.2 shapes: lowered for cuda and tpu on a CPU machine
(no execution), plus a real-shape run behind the `accelerator` marker.

Lowering builds the Triton IR / Mosaic module on CPU, so a kernel that the Triton or Mosaic
lowering rejects (non-power-of-two loads, unsupported primitives, bad block shapes) fails
here without the hardware. What only the device compiler checks (PTX / Mosaic layout
passes) is left to the accelerator test.
"""
import re
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlco.pallas.fp8_rows import fp8_row_bytes, quantize_kv_rows
from jlco.pallas.sparse_mla import sparse_mla_decode, sparse_mla_decode_ref

B, H, D_QK, D_ROPE, TOPK, N_ROWS = 2, 128, 576, 64, 2048, 200_000
SCALE = 192 ** -0.5
CUSTOM_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _specs(fmt, s_q):
    width = fp8_row_bytes(D_QK - D_ROPE, D_ROPE) if fmt == "fp8" else D_QK
    kv_dtype = jnp.uint8 if fmt == "fp8" else jnp.bfloat16
    return (jax.ShapeDtypeStruct((B, s_q, H, D_QK), jnp.bfloat16),
            jax.ShapeDtypeStruct((N_ROWS, width), kv_dtype),
            jax.ShapeDtypeStruct((B, s_q, TOPK), jnp.int32))


def _lower_text(fn, args, platforms):
    """StableHLO text of fn lowered for `platforms`; jax.export is the fallback API."""
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()
    except TypeError:
        return jax.export.export(jax.jit(fn), platforms=platforms)(*args).mlir_module()


def _targets(text):
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)", text)


@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_at_real_shapes(platform, fmt, s_q):
    fn = lambda q, kv, idx: sparse_mla_decode(q, kv, idx, SCALE, kv_format=fmt)
    targets = _targets(_lower_text(fn, _specs(fmt, s_q), (platform,)))
    assert targets == [CUSTOM_CALL[platform]], targets


def test_explicit_backend_is_not_silently_swapped():
    """An explicit backend lowers to its own kernel: Triton for tpu must fail, not fall
    back to another kernel. jax refuses Triton compiler params on tpu either in its
    platform check (ValueError) or, when that check is skipped (seen under xdist, with
    other lowerings earlier in the process), in the Mosaic lowering's own assertion that
    the params are Mosaic ones (AssertionError); both mean no kernel was swapped in."""
    fn = lambda q, kv, idx: sparse_mla_decode(q, kv, idx, SCALE, kv_format="bf16",
                                              backend="triton")
    with pytest.raises((ValueError, AssertionError)) as err:
        _lower_text(fn, _specs("bf16", 1), ("tpu",))
    if err.type is ValueError:
        assert "cannot be used for tpu lowering" in str(err.value)
    else:
        assert any("pallas_call_registration" in str(t.path) for t in err.traceback)


def _accelerator():
    return jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")


@pytest.mark.accelerator
@pytest.mark.skipif(not _accelerator(), reason="needs a GPU or TPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("s_q", [1, 2])
def test_real_shapes_on_accelerator(fmt, s_q):
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (B, s_q, H, D_QK), jnp.bfloat16)
    rows = jax.random.normal(k[1], (N_ROWS, D_QK), jnp.float32)
    kv = quantize_kv_rows(rows, D_ROPE) if fmt == "fp8" else rows.astype(jnp.bfloat16)
    idx = jax.random.randint(k[2], (B, s_q, TOPK), -100, N_ROWS).astype(jnp.int32)
    idx = jnp.where(idx < 0, -1, idx).at[0, 0].set(-1)
    run = jax.jit(lambda q, kv, idx: sparse_mla_decode(q, kv, idx, SCALE, kv_format=fmt))
    out, lse = jax.block_until_ready(run(q, kv, idx))
    ref_out, ref_lse = sparse_mla_decode_ref(q, kv, idx, SCALE, kv_format=fmt)
    chex.assert_shape(out, (B, s_q, H, D_QK - D_ROPE))   # [b, s_q, h, d_v]
    chex.assert_shape(lse, (B, s_q, H))
    chex.assert_type([out, lse], [jnp.bfloat16, jnp.float32])
    # bf16 q/p into the MMA, bf16 output (8 mantissa bits): see
    # tests/pallas/test_sparse_mla.py TOLS.
    chex.assert_trees_all_close(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                                atol=2e-2, rtol=2e-2)
    chex.assert_trees_all_equal(np.isinf(lse), np.isinf(ref_lse))
    # lse is f32 but its scores come from bf16 q against 2048 rows, |score| up to ~10:
    # 2e-3 relative with a 2e-2 floor for scores near zero.
    chex.assert_trees_all_close(np.asarray(lse), np.asarray(ref_lse), atol=2e-2, rtol=2e-3)
    n_iter = 20
    start = time.perf_counter()
    for _ in range(n_iter):
        out, lse = run(q, kv, idx)
    jax.block_until_ready((out, lse))
    sec = (time.perf_counter() - start) / n_iter
    flops = 2 * B * s_q * H * TOPK * (D_QK + D_QK - D_ROPE)
    print(f"sparse_mla {fmt} s_q={s_q}: {sec * 1e6:.1f} us, {flops / sec / 1e12:.1f} TFLOP/s")
