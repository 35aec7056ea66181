"""Block sizes per (device, kernel, dtype, shape bucket), as data.

Kernels ask `lookup(...)` instead of hard-coding tile sizes, so retuning for a new chip is
an edit to `TABLE` (or the output of a tuning tool), not to kernel code.

Key schema of `TABLE`:  (device_kind, kernel, dtype, bucket) -> {param: int}
  device_kind  `jax.Device.device_kind` ("NVIDIA H200", "TPU v5 lite", ...) or a platform
               name ("cuda", "tpu", "cpu") as the per-platform fallback.
  kernel       "indexer" | "sparse_mla".
  dtype        key/cache format: "bf16" | "f32" | "fp8", or "*" for any.
  bucket       `bucket(kernel, **shape)`: "short" / "long" context for the indexer
               (split at 8192 tokens), "h<=64" / "h>64" query heads for sparse_mla;
               "*" for any.
Params: indexer -> block_n (keys per MMA tile), block_h (heads per MMA), steps (tiles
per program, Triton only: queries are loaded once per program, so more steps = fewer
query reloads but fewer programs), num_warps, num_stages (Triton only). sparse_mla -> block_h (heads per program), block_k (selected
rows per inner step), num_warps / num_stages (Triton only). Callers narrow a value to the
call's shape (a block_h must divide the head count, a block_k need not exceed top-k).
Lookup order: exact key, then dtype "*", then bucket "*", then both, first for the device
kind and then for its platform; `DEFAULTS[kernel]` last.

Provenance: the entries below are first choices from the hardware limits (Triton tiles
kept <= 64 KiB of f32 accumulator per program; TPU key tiles sized so two buffers of keys
fit well inside 16 MiB scoped VMEM and the MXU sees 128/256-multiples). They have NOT yet
been measured on the devices; `tools/bench_kernels.py --block_n=...` is how to check one.
"""

from __future__ import annotations

from typing import Mapping

import jax

KERNELS = ("indexer", "sparse_mla")
PLATFORMS = ("cuda", "tpu", "cpu")

DEFAULTS: Mapping[str, Mapping[str, int]] = {
    "indexer": {"block_n": 128, "block_h": 64, "steps": 1, "num_warps": 4, "num_stages": 2},
    "sparse_mla": {"block_h": 64, "block_k": 32},
}

TABLE: Mapping[tuple[str, str, str, str], Mapping[str, int]] = {
    # Platform fallbacks.
    ("cuda", "indexer", "*", "*"): {"block_n": 128, "block_h": 64, "steps": 4,
                                   "num_warps": 4, "num_stages": 2},
    ("tpu", "indexer", "*", "*"): {"block_n": 1024, "block_h": 64},
    ("cpu", "indexer", "*", "*"): {"block_n": 256, "block_h": 64, "steps": 2},
    ("cuda", "sparse_mla", "*", "*"): {"block_h": 64, "block_k": 32, "num_warps": 8,
                                      "num_stages": 2},
    ("tpu", "sparse_mla", "*", "*"): {"block_h": 128, "block_k": 128},
    ("cpu", "sparse_mla", "*", "*"): {"block_h": 64, "block_k": 64},
    # Hopper: bigger key tiles once the context is long enough to fill 132 SMs.
    ("NVIDIA H200", "indexer", "bf16", "long"): {"block_n": 128, "block_h": 64, "steps": 8,
                                                 "num_warps": 8, "num_stages": 3},
    ("NVIDIA H200", "indexer", "fp8", "long"): {"block_n": 256, "block_h": 64, "steps": 4,
                                                "num_warps": 8, "num_stages": 3},
    ("NVIDIA H100 80GB HBM3", "indexer", "fp8", "long"): {"block_n": 256, "block_h": 64,
                                                          "steps": 4, "num_warps": 8,
                                                          "num_stages": 3},
    # TPU v5e (16 MiB scoped VMEM, 4x128x128 MXU) and v6e (256x256 MXU).
    ("TPU v5 lite", "indexer", "*", "long"): {"block_n": 2048, "block_h": 64},
    ("TPU v6 lite", "indexer", "*", "long"): {"block_n": 2048, "block_h": 64},
    ("TPU v5 lite", "sparse_mla", "*", "*"): {"block_h": 128, "block_k": 128},
}

_LONG_CONTEXT = 8192


def bucket(kernel: str, *, context: int | None = None, heads: int | None = None) -> str:
    """Shape bucket for a kernel call (see the key schema above)."""
    if kernel == "indexer":
        return "long" if (context or 0) > _LONG_CONTEXT else "short"
    if kernel == "sparse_mla":
        return "h>64" if (heads or 0) > 64 else "h<=64"
    raise ValueError(f"kernel={kernel!r} is invalid: allowed {KERNELS}")


def local_device_kind(platform: str) -> str:
    """The first local device's kind if it belongs to `platform`, else the platform name
    (lowering for cuda on a CPU machine gets the cuda fallback entries)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return platform
    local = "cuda" if dev.platform in ("gpu", "cuda", "rocm") else dev.platform
    return dev.device_kind if local == platform else platform


def lookup(kernel: str, *, platform: str, dtype: str, device_kind: str | None = None,
           context: int | None = None, heads: int | None = None) -> dict[str, int]:
    """Block sizes for one kernel call; always returns a complete parameter dict."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is invalid: allowed {KERNELS}")
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is invalid: allowed {PLATFORMS}")
    kind = device_kind if device_kind is not None else local_device_kind(platform)
    bkt = bucket(kernel, context=context, heads=heads)
    result = dict(DEFAULTS[kernel])
    for dev in (kind, platform):
        for key in ((dev, kernel, dtype, bkt), (dev, kernel, "*", bkt),
                    (dev, kernel, dtype, "*"), (dev, kernel, "*", "*")):
            if key in TABLE:
                result.update(TABLE[key])
                return result
    return result
