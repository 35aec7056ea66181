"""Emulation of the deployed indexer numerics: Hadamard rotation + fp8 e4m3 with UE8M0 scales.

DeepSeek's reference rotates indexer q and k by an orthonormal Hadamard (which leaves
q·k unchanged) to spread outliers, then quantises both to e4m3 per block of values with a
power-of-two scale (docs/facts.md §1 step 3). Scores computed from the dequantised values equal
the fp8 kernel's result (the power-of-two scales multiply exactly). Scales are built
with bit operations because `exp2` is not exact on XLA:CPU (docs/facts.md §5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0
_AMAX_FLOOR = 1e-4


def hadamard_matrix(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard [n, n] (n a power of two), scaled by n^-0.5."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size n={n} must be a power of two")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """x @ H over the last axis, in f32."""
    h = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), h)


def pow2_ceil(x: jax.Array) -> jax.Array:
    """2^ceil(log2(x)) for positive normal f32 x, exact, via the exponent bits."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    exp = exp + (mant != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def quantize_e4m3(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-`block` e4m3 quantisation over the last axis with UE8M0 scales.

    Returns (values float8_e4m3fn [..., d], scales f32 [..., d // block]); dequantised
    value = values * scale. Scale = 2^ceil(log2(max(amax, 1e-4) / 448)).
    """
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"quantize_e4m3: last dim {d} is not a multiple of block={block}")
    xb = x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), _AMAX_FLOOR)
    scale = pow2_ceil(amax / E4M3_MAX)
    q = (xb / scale[..., None]).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize_e4m3(q: jax.Array, scale: jax.Array) -> jax.Array:
    d = q.shape[-1]
    nb = scale.shape[-1]
    qb = q.astype(jnp.float32).reshape(*q.shape[:-1], nb, d // nb)
    return (qb * scale[..., None]).reshape(q.shape)


def fp8_roundtrip(x: jax.Array, block: int) -> jax.Array:
    """What the fp8 kernel effectively sees: quantise then dequantise (f32)."""
    return dequantize_e4m3(*quantize_e4m3(x, block))


def indexer_block(d: int) -> int:
    """Quantisation block for indexer vectors: 128 values, or the whole vector if shorter
    (tiny test models), so a real 128-dim key has exactly one scale (132 B per token)."""
    return min(128, d)
