"""A finished prefill as it travels from a prefill node to a decode node (PD
disaggregation): the prompt, the room reserved for generation, every cache layer's latent
rows and indexer keys (+ scales) for the prompt's positions, the top-k sets of the last
prefill queries (to warm the decode node's hot buffer) and the last position's final
hidden state (the decode node computes the first token's logits from it, with its own
sampling parameters, exactly as a local prefill would).

Wire format: one safetensors blob. Tensors `latent.{layer}` uint8 [n, row_bytes],
`index_k.{layer}` [n, D] (f32, uint16 bf16 bits or uint8 e4m3, as the cache stores them),
`index_scale.{layer}` f32 [n] (fp8 keys only), `record` int32 [layers, w, k] (optional),
`hidden` f32 [d]; metadata `format` = FORMAT, `prompt` (JSON list of ids),
`max_new_tokens`. `check(cfg)` refuses anything whose shapes or dtypes do not match the
receiving engine's cache, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

FORMAT = "jlco-prefill-v1"
_DTYPES = {"U8": np.uint8, "U16": np.uint16, "I32": np.int32, "F32": np.float32}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


@dataclasses.dataclass
class PrefilledRequest:
    prompt: list[int]
    max_new_tokens: int
    latent: list[np.ndarray]              # per cache layer uint8 [n, row_bytes]
    index_k: list[np.ndarray]             # per cache layer [n, D]
    index_scale: list[np.ndarray] | None  # per cache layer f32 [n] (fp8 keys)
    record: np.ndarray | None             # int32 [layers, w, k], oldest query first
    hidden: np.ndarray                    # f32 [d]

    def check(self, cfg) -> None:
        """ValueError naming the first field that does not fit `cfg`'s engine."""
        from jlco.model.kv_cache import _key_storage_dtype, cache_layers
        n, layers, m = len(self.prompt), cache_layers(cfg), cfg.model
        if n < 1 or not all(isinstance(t, int) and 0 <= t < m.vocab_size for t in self.prompt):
            raise ValueError(f"prompt: allowed a non-empty list of token ids in "
                             f"0..{m.vocab_size - 1}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: allowed an integer >= 1")
        if n + self.max_new_tokens > cfg.engine.max_context_len:
            raise ValueError(f"prompt ({n}) + max_new_tokens ({self.max_new_tokens}) exceeds "
                             f"engine.max_context_len={cfg.engine.max_context_len}")
        key_dt = np.dtype(_key_storage_dtype(cfg))
        want = {"latent": ((n, cfg.row_bytes), np.dtype(np.uint8), self.latent),
                "index_k": ((n, m.index_head_dim), key_dt, self.index_k)}
        fp8 = cfg.cache.indexer_key_format == "fp8"
        if fp8 != (self.index_scale is not None):
            raise ValueError(f"index_scale: {'required' if fp8 else 'not allowed'} with "
                             f"cache.indexer_key_format={cfg.cache.indexer_key_format!r}")
        if fp8:
            want["index_scale"] = ((n,), np.dtype(np.float32), self.index_scale)
        for name, (shape, dtype, arrs) in want.items():
            if len(arrs) != layers:
                raise ValueError(f"{name}: {len(arrs)} layers, this model caches {layers}")
            for i, a in enumerate(arrs):
                # a layer that shares its top-k (IndexShare) caches zero-width keys
                want_shape = (shape[:-1] + (0,) if name != "latent" and m.shares_topk(i)
                              else shape)
                if a.shape != want_shape or a.dtype != dtype:
                    raise ValueError(f"{name}.{i}: {a.dtype}{list(a.shape)} does not match this "
                                     f"engine's cache: allowed {dtype}{list(want_shape)} (kv_format "
                                     f"{cfg.cache.kv_format!r}, indexer_key_format "
                                     f"{cfg.cache.indexer_key_format!r})")
        if self.hidden.shape != (m.hidden_size,) or self.hidden.dtype != np.float32:
            raise ValueError(f"hidden: {self.hidden.dtype}{list(self.hidden.shape)}: allowed "
                             f"float32[{m.hidden_size}]")
        if self.record is not None:
            r = self.record
            if r.dtype != np.int32 or r.ndim != 3 or r.shape[0] != layers \
                    or r.shape[2] != m.index_topk or not 1 <= r.shape[1] <= n:
                raise ValueError(f"record: {r.dtype}{list(r.shape)}: allowed int32[{layers}, w, "
                                 f"{m.index_topk}] with 1 <= w <= {n}")
            if (r >= n).any() or (r < -1).any():
                raise ValueError(f"record: positions must be in -1..{n - 1}")

    # ---- wire format ----------------------------------------------------------------
    def to_bytes(self) -> bytes:
        tensors = {"hidden": self.hidden}
        for i, (lat, key) in enumerate(zip(self.latent, self.index_k)):
            tensors[f"latent.{i}"], tensors[f"index_k.{i}"] = lat, key
        for i, sc in enumerate(self.index_scale or ()):
            tensors[f"index_scale.{i}"] = sc
        if self.record is not None:
            tensors["record"] = self.record
        header, blobs, off = {}, [], 0
        for name, a in tensors.items():
            a = np.ascontiguousarray(a)
            if a.dtype not in _NAMES:
                raise ValueError(f"{name}: dtype {a.dtype} has no safetensors name here")
            header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                            "data_offsets": [off, off + a.nbytes]}
            blobs.append(a.tobytes())
            off += a.nbytes
        header["__metadata__"] = {"format": FORMAT, "prompt": json.dumps(self.prompt),
                                  "max_new_tokens": str(self.max_new_tokens)}
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefilledRequest:
        """Parse a payload; anything malformed is a ValueError saying what."""
        if len(data) < 8:
            raise ValueError("payload: not a safetensors blob (shorter than its header size)")
        (size,) = struct.unpack("<Q", data[:8])
        if size > len(data) - 8:
            raise ValueError("payload: not a safetensors blob (header size past the end)")
        try:
            header = json.loads(data[8:8 + size])
            meta = header.pop("__metadata__")
            if meta.get("format") != FORMAT:
                raise ValueError(f"payload: format {meta.get('format')!r}, allowed {FORMAT!r}")
            prompt = json.loads(meta["prompt"])
            max_new = int(meta["max_new_tokens"])
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"payload: bad safetensors header or metadata ({err})") from None
        body = memoryview(data)[8 + size:]
        arrs = {}
        for name, e in header.items():
            try:
                dt = np.dtype(_DTYPES[e["dtype"]])
                lo, hi = e["data_offsets"]
                shape = tuple(int(x) for x in e["shape"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"payload: tensor {name!r}: bad entry {e!r}") from None
            if not 0 <= lo <= hi <= len(body) or hi - lo != int(np.prod(shape)) * dt.itemsize:
                raise ValueError(f"payload: tensor {name!r}: offsets {lo}..{hi} do not fit")
            arrs[name] = np.frombuffer(body[lo:hi], dt).reshape(shape).copy()
        layers = sum(1 for k in arrs if k.startswith("latent."))

        def per_layer(prefix):
            out = [arrs.get(f"{prefix}.{i}") for i in range(layers)]
            if any(a is None for a in out):
                raise ValueError(f"payload: {prefix}.0..{layers - 1} incomplete")
            return out
        if "hidden" not in arrs or not layers:
            raise ValueError("payload: needs `hidden` and `latent.*` tensors")
        scales = per_layer("index_scale") if "index_scale.0" in arrs else None
        return cls(prompt=prompt, max_new_tokens=max_new, latent=per_layer("latent"),
                   index_k=per_layer("index_k"), index_scale=scales,
                   record=arrs.get("record"), hidden=arrs["hidden"])


def export_job(job, max_new_tokens: int) -> PrefilledRequest:
    """A finished `jlco.engine.prefill.PrefillJob` (started with record=True) as a
    `PrefilledRequest`: its cache rows for the prompt's positions, the last piece's
    top-k sets (oldest first, real queries only) and the last hidden state."""
    import jax
    assert job.finished, "export: pieces left"
    n, cache = len(job.req.prompt), job.cache
    latent, keys, scales, hidden = jax.device_get((cache.latent, cache.index_k,
                                                   cache.index_scale, job.hidden))
    rec = job.warmup_record()
    record = None if rec is None else np.asarray(rec)[:, -job.warmup_width:].astype(np.int32)
    return PrefilledRequest(
        prompt=list(job.req.prompt), max_new_tokens=max_new_tokens,
        latent=[np.asarray(x[0, :n]) for x in latent],
        index_k=[np.asarray(x[0, :n]) for x in keys],
        index_scale=None if scales is None else [np.asarray(x[0, :n]) for x in scales],
        record=record, hidden=np.asarray(hidden[0], np.float32))


def import_cache(cfg, p: PrefilledRequest, max_len: int):
    """The one-request cache an imported prefill installs from: its rows at positions
    0..n-1 of a fresh [1, max_len] `DecodeCache`, length n."""
    import dataclasses as dc

    import jax.numpy as jnp

    from jlco.model.kv_cache import init_cache
    n = len(p.prompt)
    cache = init_cache(cfg, batch=1, max_len=max_len)

    def put(arrs, vals):
        return tuple(a.at[0, :n].set(jnp.asarray(v)) for a, v in zip(arrs, vals))
    return dc.replace(
        cache, latent=put(cache.latent, p.latent), index_k=put(cache.index_k, p.index_k),
        index_scale=None if p.index_scale is None else put(cache.index_scale, p.index_scale),
        lengths=jnp.full((1,), n, jnp.int32))
