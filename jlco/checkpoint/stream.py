"""Sharded, streaming HF → model loading: each device gets only its slice of each weight.

Every parameter is made with `jax.make_array_from_callback`; the callback reads just the
slice a device asks for from the memory-mapped safetensors file, in torch layout, and
applies the HF → jlco transform to that slice (transpose, kv_b_proj's nope/value halves,
fp8 block dequantisation with the scales of just the selected 128×128 blocks, expert
stacking one expert's slice at a time). Each tensor's map is dropped as soon as its slice
is copied out, so file pages never pile up in the resident set. The slice is written
straight into a 64-byte-aligned array of the parameter's dtype, which the CPU backend
adopts without a copy (an accelerator copies it and the host array is freed), so host
memory peaks near one device's slice of one parameter beyond the device arrays
themselves, not at the whole checkpoint (≈700 GB for the released model). A replicated
parameter is read once per device that holds it.

Values are bit-identical to reading whole tensors (`load.load_hf_checkpoint` +
`hf_names.model_from_hf`): each element takes the same casts (source dtype → the load
dtype → the parameter dtype) and the same fp8 product (e4m3 as f32 × its block's f32
scale), which are element-wise.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import tqdm
from flax import nnx

from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.hf_names import param_sources
from jlco.checkpoint.safetensors_io import FP8_BLOCK, CheckpointError
from jlco.config import ModelConfig
from jlco.model.decoder import DeepseekV32

# A Sharding for every parameter, a callable (path tuple, abstract nnx.Variable) → Sharding,
# or a pytree shaped like the model's state (nnx.State or nested dict) with Sharding leaves.
Shardings = Any


@dataclasses.dataclass
class HFIndex:
    """A validated HF checkpoint whose tensors have not been read: `plan` maps each
    loaded tensor name to (entry, fp8 scale entry | None)."""
    config: ModelConfig
    plan: dict[str, tuple[st.TensorEntry, st.TensorEntry | None]]
    has_mtp: bool
    path: pathlib.Path
    tokenizer_path: pathlib.Path | None

    def nbytes(self, dtype: np.dtype) -> int:
        """Bytes of every loaded tensor in `dtype` (what a whole-tensor load holds)."""
        return sum(math.prod(e.shape) for e, _ in self.plan.values()) * np.dtype(dtype).itemsize


def check_finite(name: str, e: st.TensorEntry, arr: np.ndarray,
                 where: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None) -> None:
    """A NaN or Inf weight decodes to garbage (or NaN log-probs) without any error, so
    it is a load error naming the tensor and its shard. Checked after dequantisation, so
    a bad fp8 block scale is caught too. `where` maps an index of `arr` (a slice) to the
    index in the whole tensor; counts are then the slice's."""
    bad = ~np.isfinite(arr)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        first = where(first) if where else first
        raise CheckpointError(f"tensor {name!r} ({e.file.name}) has {int(bad.sum())} "
                              f"non-finite value(s) (NaN/Inf), the first at index "
                              f"{list(first)}: allowed finite weights only")


def _norm(index: tuple, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A device's index (slices, possibly open) as explicit unit-step slices, one per dim."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError(f"internal: strided shard index {s} is not supported")
        out.append(slice(a, b))
    return tuple(out)


def _aligned(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data is `align`-byte aligned: the CPU backend adopts
    such a buffer without copying it, so a parameter is not held twice while placed."""
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    buf = np.empty(n + align, np.uint8)
    off = -buf.ctypes.data % align
    return buf[off:off + n].view(dtype).reshape(shape)


def _extent(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


class TensorReader:
    """Slices of HF tensors, cast to `out_dt` (fp8 dequantised), read from memory maps."""

    def __init__(self, plan: Mapping[str, tuple[st.TensorEntry, st.TensorEntry | None]],
                 out_dt: np.dtype):
        self.plan, self.out_dt = plan, np.dtype(out_dt)

    def read_into(self, name: str, index: tuple[slice, ...], dst: np.ndarray,
                  view: tuple[int, ...] | None = None) -> None:
        """dst[...] = `tensor.reshape(view)[index]` (torch layout; `view` defaults to the
        tensor's own shape; `dst` may be a transposed view) through the load dtype: each
        value is cast to `out_dt`, checked finite, then cast to dst's dtype. No map
        outlives the call."""
        e, scale = self.plan[name]
        mm = st.read_tensor(e)
        view = tuple(view or e.shape)
        index = _norm(index, view)
        raw = mm.reshape(view)[index]
        if e.dtype == "F8_E4M3":
            val = (np.asarray(raw, np.float32) * self._scales(e, scale, view, index)
                   ).astype(self.out_dt, copy=False)
        elif dst.dtype == self.out_dt:
            np.copyto(dst, raw, casting="unsafe")
            val = dst
        else:
            val = raw.astype(self.out_dt)
        del raw, mm
        check_finite(name, e, val, lambda i: _whole_index(e.shape, view, index, i))
        if val is not dst:
            np.copyto(dst, val, casting="unsafe")

    @staticmethod
    def _scales(e: st.TensorEntry, scale: st.TensorEntry, view: tuple[int, ...],
                index: tuple[slice, ...]) -> np.ndarray:
        """The f32 block scale of every selected element of the 2-D fp8 tensor `e`."""
        rows = np.arange(math.prod(view[:-1])).reshape(view[:-1])[index[:-1]]
        cols = np.arange(view[-1])[index[-1]]
        s = np.asarray(st.read_tensor(scale), np.float32)
        return s[rows[..., None] // FP8_BLOCK, cols // FP8_BLOCK]


def _whole_index(shape, view, index, i) -> tuple[int, ...]:
    """Index in the whole tensor (`shape`) of element `i` of `reshape(view)[index]`."""
    in_view = [s.start + k for s, k in zip(index, i)]
    return tuple(int(x) for x in np.unravel_index(np.ravel_multi_index(in_view, view), shape))


def _param_callback(reader: TensorReader, how, names: tuple[str, ...], cfg: ModelConfig,
                    shape: tuple[int, ...], dtype: np.dtype) -> Callable[[tuple], np.ndarray]:
    """The make_array_from_callback callback of one parameter: jlco-layout index → slice,
    written straight into an aligned array of the parameter's dtype."""
    h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim

    def cb(index: tuple) -> np.ndarray:
        index = _norm(index, shape)
        out = _aligned(_extent(index), dtype)
        if how == "expert":                                     # [E, in, out] ← E × [out, in]
            e_ix, i_ix, o_ix = index
            for k, e in enumerate(range(len(names))[e_ix]):     # one expert at a time
                reader.read_into(names[e], (o_ix, i_ix), out[k].T)
        elif isinstance(how, tuple):                            # [h, n or v, c] of kv_b_proj
            h_ix, j_ix, c_ix = index
            e = reader.plan[names[0]][0]
            off = 0 if how[1] == "nope" else nope
            reader.read_into(names[0], (h_ix, slice(j_ix.start + off, j_ix.stop + off), c_ix),
                             out, (h, e.shape[0] // h, e.shape[1]))
        elif how:                                               # [in, out] ← [out, in]
            reader.read_into(names[0], index[::-1], out.T)
        else:
            reader.read_into(names[0], index, out)
        return out

    return cb


def sharding_for(shardings: Shardings, path: tuple, var: nnx.Variable) -> jax.sharding.Sharding:
    """The Sharding of parameter `path` (see `Shardings`); default: the first device."""
    if shardings is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if callable(shardings):
        got = shardings(path, var)
    else:
        got = shardings
        for k in path:
            got = got[k] if not isinstance(got, Mapping) or k in got else got[str(k)]
    got = got.get_value() if isinstance(got, nnx.Variable) else got
    if not isinstance(got, jax.sharding.Sharding):
        raise TypeError(f"shardings gives {type(got).__name__} for parameter "
                        f"{'/'.join(map(str, path))}: allowed a jax.sharding.Sharding")
    return got


def build_model(index: HFIndex, out_dt: np.dtype, *, shardings: Shardings = None,
                progress: bool = True) -> DeepseekV32:
    """The model of a validated checkpoint, each parameter laid out by its sharding and
    read slice by slice (see the module docstring)."""
    cfg = index.config
    sources = param_sources(cfg, mtp=index.has_mtp)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV32(cfg, rngs=nnx.Rngs(0))))
    flat = list(nnx.to_flat_state(state))
    reader = TensorReader(index.plan, out_dt)
    bar = tqdm.tqdm(flat, desc="loading HF weights", unit="param", file=sys.stderr,
                    disable=not (progress and sys.stderr.isatty()))   # no bars in logs
    for path, var in bar:
        path = tuple(path)
        if path not in sources:
            raise ValueError(f"internal: parameter {'/'.join(map(str, path))} has no HF tensor")
        how, names = sources[path]
        bar.set_postfix_str(index.plan[names[0]][0].file.name, refresh=False)
        want = var.get_value()
        cb = _param_callback(reader, how, names, cfg, tuple(want.shape), np.dtype(want.dtype))
        var.set_value(jax.make_array_from_callback(
            tuple(want.shape), sharding_for(shardings, path, var), cb, dtype=want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
