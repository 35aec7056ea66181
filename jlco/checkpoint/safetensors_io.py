"""safetensors files read and written from the documented header, plus fp8 block scaling.

Why not `safetensors.safe_open(..., framework="numpy")`: with safetensors 0.8 it raises
for F8_E4M3 (it looks up `np.float8_e4m3fn`, which numpy lacks) and returns BF16 only if
`ml_dtypes` happened to be imported first (numpy resolves the dtype by name). The format
is small and documented (8-byte little-endian header length, JSON header
`{name: {dtype, shape, data_offsets}}`, raw little-endian data), so we read it directly
with `ml_dtypes` for bf16/fp8 and memory-map the data (little-endian hosts only); tests check our reader and writer
against the library on the dtypes it does support.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import struct
import sys
from typing import Mapping

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0

# Dtypes a checkpoint tensor may have; anything else is rejected by name.
SUPPORTED_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
                    "F16": np.dtype(np.float16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}
# Dtypes we can parse (and so report precisely), a superset of the supported ones.
_KNOWN_DTYPES = SUPPORTED_DTYPES | {
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
_HEADER_LIMIT = 100 << 20
if sys.byteorder != "little":  # safetensors data is little-endian; we map it as native
    raise ImportError("jlco.checkpoint.safetensors_io needs a little-endian host")


class CheckpointError(ValueError):
    """A checkpoint is malformed or does not match the model; the message names the tensor
    (and the shard file) or the path at fault."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live: absolute byte range in `file`."""
    name: str
    file: pathlib.Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: str | os.PathLike) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header into entries, checking each byte range."""
    file = pathlib.Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < n <= min(_HEADER_LIMIT, size - 8):
            raise CheckpointError(f"{file}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise CheckpointError(f"{file}: safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: safetensors header is not a JSON object")
    base = 8 + n
    entries = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        b, e, shape = _entry_fields(file, name, d)
        dt = _KNOWN_DTYPES.get(d["dtype"])
        if dt is not None and e - b != math.prod(shape) * dt.itemsize:
            raise CheckpointError(f"tensor {name!r} ({file.name}): {e - b} bytes for "
                                  f"{d['dtype']}{list(shape)}")
        if not 0 <= b <= e <= size - base:
            raise CheckpointError(f"tensor {name!r} ({file.name}): data range [{b}, {e}) "
                                  f"outside the file")
        entries[name] = TensorEntry(name, file, d["dtype"], shape, base + b, base + e)
    return entries


def _entry_fields(file: pathlib.Path, name: str, d) -> tuple[int, int, tuple[int, ...]]:
    """(begin, end, shape) of one header entry, or a CheckpointError naming the tensor."""
    try:
        b, e = (int(x) for x in d["data_offsets"])
        shape = tuple(int(s) for s in d["shape"])
        str(d["dtype"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"tensor {name!r} ({file.name}): malformed header entry {d!r}: "
                              "allowed {dtype, shape: [ints], data_offsets: [begin, end]}"
                              ) from None
    return b, e, shape


def index_checkpoint(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """All tensor entries of a HF checkpoint dir: sharded (index JSON) or single file."""
    path = pathlib.Path(path)
    index = path / INDEX_FILE
    if not index.is_file():
        if not (path / SINGLE_FILE).is_file():
            raise CheckpointError(f"{str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        return read_header(path / SINGLE_FILE)
    weight_map = read_weight_map(index)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        names = [n for n, s in weight_map.items() if s == missing[0]][:3]
        raise CheckpointError(f"{INDEX_FILE} lists shard file(s) {missing} that do not exist "
                              f"in {str(path)!r} (e.g. holding {names})")
    entries: dict[str, TensorEntry] = {}
    for shard in shards:
        for name, e in read_header(path / shard).items():
            if weight_map.get(name) != shard:
                raise CheckpointError(f"tensor {name!r} is in shard {shard} but {INDEX_FILE}"
                                      f" maps it to {weight_map.get(name)!r}")
            entries[name] = e
    lost = [n for n in weight_map if n not in entries]
    if lost:
        raise CheckpointError(f"tensor {lost[0]!r} is listed in {INDEX_FILE} under shard "
                              f"{weight_map[lost[0]]} but that shard does not hold it "
                              f"({len(lost)} such tensor(s))")
    return entries


def read_weight_map(index: pathlib.Path) -> dict[str, str]:
    """The index's `weight_map` {tensor name: shard file}, each shard a plain relative
    path inside the checkpoint directory: an absolute path or one with a `..` component
    is refused, naming the entry, so a downloaded index cannot make us read (and report
    on) files elsewhere. Symlinked shards are allowed: the Hugging Face hub cache links
    every snapshot file into its blobs/ directory."""
    try:
        doc = json.loads(index.read_text())
    except ValueError as err:
        raise CheckpointError(f"{index}: not valid JSON ({err})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: needs a non-empty \"weight_map\" object "
                              "{tensor name: shard file}")
    for name, shard in weight_map.items():
        _check_shard_name(index, name, shard)
    return weight_map


def _check_shard_name(index: pathlib.Path, name: str, shard) -> None:
    where = f"{index.name} entry {name!r}"
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{where}: shard {shard!r} is invalid: allowed a file name")
    pure = pathlib.PurePosixPath(shard.replace("\\", "/"))
    if pure.is_absolute() or pathlib.PureWindowsPath(shard).anchor or ".." in pure.parts:
        raise CheckpointError(f"{where}: shard path {shard!r} points outside the checkpoint "
                              f"directory {str(index.parent)!r}: allowed a relative path "
                              "inside it (no '..', not absolute)")


def read_tensor(e: TensorEntry) -> np.ndarray:
    """A read-only memory map of one tensor (no copy until the caller converts it)."""
    dt = SUPPORTED_DTYPES.get(e.dtype)
    if dt is None:
        raise CheckpointError(f"tensor {e.name!r} ({e.file.name}) has unsupported dtype "
                              f"{e.dtype}: allowed " + ", ".join(SUPPORTED_DTYPES))
    if e.end == e.start:
        return np.zeros(e.shape, dt)
    return np.memmap(e.file, dtype=dt, mode="r", offset=e.start, shape=e.shape)


def write_safetensors(file: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` in safetensors format (the tool that makes fp8 copies uses this)."""
    names = {v: k for k, v in _KNOWN_DTYPES.items()}
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for name, a in tensors.items():
        if np.dtype(a.dtype) not in names:
            raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        header[name] = {"dtype": names[np.dtype(a.dtype)], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as the library does
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


def _expand_blocks(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    s = np.repeat(np.repeat(np.asarray(scale, np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)
    return s[: shape[0], : shape[1]]


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """f32 weight = fp8 w × scale_inv of its 128×128 block (edge blocks may be ragged)."""
    if w.ndim != 2:
        raise CheckpointError(f"fp8 block dequantisation needs a 2-D weight, got {w.shape}")
    want = tuple(-(-n // FP8_BLOCK) for n in w.shape)
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"scale_inv shape {tuple(scale_inv.shape)} != {want} for "
                              f"weight {w.shape}")
    return np.asarray(w, np.float32) * _expand_blocks(scale_inv, w.shape)


def quantize_fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 weight, f32 scale_inv) with one scale per 128×128 block: amax maps to 448.

    The inverse of `dequantize_fp8_blocks` up to fp8 rounding; an all-zero block gets
    scale 1 so that dequantisation never multiplies by 0/0.
    """
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise CheckpointError(f"fp8 block quantisation needs a 2-D weight, got {w.shape}")
    rows, cols = (-(-n // FP8_BLOCK) for n in w.shape)
    pad = np.zeros((rows * FP8_BLOCK, cols * FP8_BLOCK), np.float32)
    pad[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = pad.reshape(rows, FP8_BLOCK, cols, FP8_BLOCK).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(w / _expand_blocks(scale, w.shape), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.astype(ml_dtypes.float8_e4m3fn)
    return q, scale
