"""FlashMLA fp8 latent-row layout: quantise / dequantise whole rows.

One row holds d_nope e4m3 bytes | d_nope/128 f32 scales | d_rope bf16 (little-endian bytes),
656 bytes for DeepSeek-V3.2 (d_nope 512, d_rope 64). Rows are stored as uint8 so host and
device caches can be updated in place (XLA:CPU rewrites whole bf16/fp8 arrays on update).

Scales are powers of two, scale = 2^ceil(log2(max(amax / 448, 1e-4))) per 128 nope values,
so a dequantised value (e4m3 code x scale) is exact in bf16. The scale is built from the f32
bit pattern, not jnp.exp2/log2, because XLA:CPU's exp2 is inexact for integer exponents.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

GROUP = 128  # nope values per f32 scale
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4
_MANTISSA_BITS = 23


def fp8_row_bytes(d_nope: int, d_rope: int) -> int:
    """Bytes of one fp8 row: e4m3 nope | f32 scale per GROUP | bf16 rope."""
    return d_nope + 4 * (d_nope // GROUP) + 2 * d_rope


def fp8_nope_dim(row_bytes: int, d_rope: int) -> int:
    """Inverse of fp8_row_bytes: d_nope from a row width, or ValueError if none fits."""
    rest = row_bytes - 2 * d_rope
    d_nope = rest * GROUP // (GROUP + 4)
    if rest <= 0 or d_nope % GROUP or fp8_row_bytes(d_nope, d_rope) != row_bytes:
        raise ValueError(
            f"fp8 row width {row_bytes} does not match d_nope + d_nope/32 + 2*d_rope for "
            f"d_rope={d_rope} with d_nope a positive multiple of {GROUP}")
    return d_nope


def pow2_scale(amax: jax.Array) -> jax.Array:
    """2^ceil(log2(max(amax/448, 1e-4))) in f32, exactly, from bit operations.

    ratio >= 1e-4 is a normal f32, so ceil(log2) is the biased exponent, plus one when any
    mantissa bit is set; the result has an empty mantissa.
    """
    ratio = jnp.maximum(amax.astype(jnp.float32) / E4M3_MAX, jnp.float32(SCALE_FLOOR))
    bits = lax.bitcast_convert_type(ratio, jnp.uint32)
    exponent = (bits >> _MANTISSA_BITS) + ((bits & ((1 << _MANTISSA_BITS) - 1)) != 0)
    return lax.bitcast_convert_type(exponent.astype(jnp.uint32) << _MANTISSA_BITS, jnp.float32)


def _to_bytes(x: jax.Array) -> jax.Array:
    """[..., k] of a w-byte dtype -> [..., k*w] uint8 in memory (little-endian) order."""
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b if b.ndim == x.ndim else b.reshape(*x.shape[:-1], -1)


def _from_bytes(b: jax.Array, dtype) -> jax.Array:
    """[..., k*w] uint8 -> [..., k] of a w-byte dtype (inverse of _to_bytes)."""
    width = jnp.dtype(dtype).itemsize
    if width == 1:
        return lax.bitcast_convert_type(b, dtype)
    return lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, width), dtype)


def _check_rows(rows: jax.Array, d_rope: int) -> int:
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        raise ValueError(f"rows must be a float array, got dtype {rows.dtype}")
    if rows.ndim < 1 or not 0 < d_rope < rows.shape[-1]:
        raise ValueError(f"d_rope must be in (0, {rows.shape[-1] if rows.ndim else 0}), "
                         f"got {d_rope} for rows of shape {rows.shape}")
    d_nope = rows.shape[-1] - d_rope
    if d_nope % GROUP:
        raise ValueError(f"rows: nope width {d_nope} (= last dim {rows.shape[-1]} - d_rope "
                         f"{d_rope}) must be a multiple of {GROUP} for the fp8 layout")
    return d_nope


@jax.named_scope("quantize_kv_rows")
def quantize_kv_rows(rows: jax.Array, d_rope: int = 64) -> jax.Array:
    """rows [..., d_nope + d_rope] float -> uint8 [..., fp8_row_bytes(d_nope, d_rope)]."""
    d_nope = _check_rows(rows, d_rope)
    lead = rows.shape[:-1]
    nope = rows[..., :d_nope].astype(jnp.float32).reshape(*lead, d_nope // GROUP, GROUP)
    scale = pow2_scale(jnp.max(jnp.abs(nope), axis=-1))  # [..., G]
    # Division by a power of two is exact; amax/scale <= 448 so the cast never saturates.
    codes = (nope / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(*lead, d_nope)
    rope = rows[..., d_nope:].astype(jnp.bfloat16)
    return jnp.concatenate([_to_bytes(codes), _to_bytes(scale), _to_bytes(rope)], axis=-1)


@jax.named_scope("dequantize_kv_rows")
def dequantize_kv_rows(data: jax.Array, d_rope: int = 64, dtype=jnp.bfloat16) -> jax.Array:
    """uint8 [..., row_bytes] -> [..., d_nope + d_rope] in dtype (exact for bf16 and wider)."""
    if data.dtype != jnp.uint8:
        raise ValueError(f"data must be uint8 fp8 rows, got dtype {data.dtype}")
    d_nope = fp8_nope_dim(data.shape[-1], d_rope)
    n_groups = d_nope // GROUP
    lead = data.shape[:-1]
    codes = _from_bytes(data[..., :d_nope], jnp.float8_e4m3fn).astype(jnp.float32)
    scale = _from_bytes(data[..., d_nope:d_nope + 4 * n_groups], jnp.float32)
    nope = (codes.reshape(*lead, n_groups, GROUP) * scale[..., None]).reshape(*lead, d_nope)
    rope = _from_bytes(data[..., d_nope + 4 * n_groups:], jnp.bfloat16)
    return jnp.concatenate([nope.astype(dtype), rope.astype(dtype)], axis=-1)
