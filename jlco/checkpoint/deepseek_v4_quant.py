"""DeepSeek-V4's quantised weight formats, dequantised to f32 at load as transformers'
`Fp8Dequantize._dequantize_one` does (docs/facts.md §7):

- fp8: an F8_E4M3 `X.weight` with `X.scale` (V4-Flash's spelling; `X.weight_scale_inv`
  also read), one scale per block of the weight;
- fp4 (routed experts, `expert_dtype: "fp4"`): an I8 / U8 `X.weight` [out, in/2], two
  e2m1 values per byte (low nibble the even element), one scale per 1 × 32 block.
Scales are F8_E8M0 / U8 exponents b (2^(b−127)), or F32 / BF16 values. The block is
read from the two grids (weight rows / scale rows, weight cols / scale cols), which
must divide exactly, as in transformers.
"""

from __future__ import annotations

import math
from typing import Mapping

import ml_dtypes
import numpy as np

from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.safetensors_io import CheckpointError

# e2m1: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_BYTE_DTYPES = ("F8_E4M3", "F8_E8M0", "I8", "U8")


def _bytes(e: st.TensorEntry) -> np.ndarray:
    n = math.prod(e.shape)
    if e.end - e.start != n:
        raise CheckpointError(f"tensor {e.name!r} ({e.file.name}): {e.end - e.start} bytes "
                              f"for {e.dtype}{list(e.shape)}")
    if n == 0:
        return np.zeros(e.shape, np.uint8)
    return np.memmap(e.file, dtype=np.uint8, mode="r", offset=e.start, shape=e.shape)


def weight_values(e: st.TensorEntry) -> np.ndarray:
    """A quantised weight's values in f32: e4m3 as is, packed fp4 unpacked [.., 2·cols]."""
    raw = _bytes(e)
    if e.dtype == "F8_E4M3":
        return raw.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if e.dtype in ("I8", "U8"):
        out = np.stack([FP4_E2M1[raw & 0xF], FP4_E2M1[raw >> 4]], axis=-1)
        return out.reshape(*raw.shape[:-1], 2 * raw.shape[-1])
    raise CheckpointError(f"tensor {e.name!r} ({e.file.name}) has dtype {e.dtype}: a "
                          "quantised weight is F8_E4M3, or I8 / U8 packed fp4")


def scale_values(e: st.TensorEntry) -> np.ndarray:
    if e.dtype in ("F8_E8M0", "U8"):
        b = np.asarray(_bytes(e))
        if (b == 255).any():
            raise CheckpointError(f"scale tensor {e.name!r} ({e.file.name}) holds the e8m0 "
                                  "NaN code 255")
        return np.exp2(b.astype(np.float32) - 127.0)
    if e.dtype in ("F32", "BF16"):
        return np.asarray(st.read_tensor(e), np.float32)
    raise CheckpointError(f"scale tensor {e.name!r} ({e.file.name}) has dtype {e.dtype}: "
                          "allowed F8_E8M0, U8 (exponents), F32, BF16")


def dequantize(w: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """w [rows, cols] f32 × the scale of its block; the block is rows / scale rows by
    cols / scale cols (a 1-D scale is one row of blocks)."""
    s = scale.reshape(1, -1) if scale.ndim == 1 else scale
    (rows, cols), (sr, sc) = w.shape[-2:], s.shape[-2:]
    if w.ndim != 2 or s.ndim != 2 or rows % sr or cols % sc:
        raise CheckpointError(f"tensor {name!r}: weight {list(w.shape)} is not a whole "
                              f"number of blocks of its scale grid {list(scale.shape)}")
    bm, bn = rows // sr, cols // sc
    return (w.reshape(sr, bm, sc, bn) * s[:, None, :, None]).reshape(rows, cols)


def pair_scales(entries: Mapping[str, st.TensorEntry]) -> dict[str, st.TensorEntry]:
    """{weight name: its scale entry} for every scale tensor; a scale with no weight, or a
    quantised weight with no scale, is a CheckpointError naming it."""
    scales: dict[str, st.TensorEntry] = {}
    for name, e in entries.items():
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            continue
        owner = name[: -len(suffix)] + (".weight" if suffix == ".scale" else "")
        if owner not in entries:
            raise CheckpointError(f"scale tensor {name!r} ({e.file.name}) has no weight "
                                  f"{owner!r} to scale")
        scales[owner] = e
    for name, e in entries.items():
        if e.dtype in ("F8_E4M3", "I8", "U8") and name not in scales:
            raise CheckpointError(f"quantised tensor {name!r} ({e.file.name}, {e.dtype}) has "
                                  f"no scale tensor ({' or '.join(SCALE_SUFFIXES)})")
    return scales


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def read_dequantized(e: st.TensorEntry, scale: st.TensorEntry) -> np.ndarray:
    return dequantize(weight_values(e), scale_values(scale), e.name)
