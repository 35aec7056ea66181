"""Native XLA:CPU kernels for decode steps, as XLA FFI custom calls: small-M f32 matmuls,
the lightning indexer's scores and its top-k.

A decode step multiplies M = batch x query tokens rows (1..8) by each weight matrix
once, so its matmuls are bound by the weight bytes. XLA:CPU streams M = 1 as a matvec
but runs M = 2..8 as a GEMM that repacks the weights on every call, at a third of the
matvec's bandwidth (M = 4 against a [512, 2048] weight: 8.6-10.9 GB/s against 25 GB/s
at M = 1; docs/journal/2026-12-06.md, sessions 19-20). `kernels.cc` streams each weight row once
for all M rows: M = 4 at 16-35 GB/s on the same box, M = 1 as fast as XLA's matvec.
`indexer_scores` forms the indexer's scores with a query's heads side by side in vector
lanes (one lane reduction per key instead of XLA's [keys, heads] logits written and
read back: 2-3x). `top_k` returns exactly `lax.top_k`'s values and positions (XLA:CPU's
order: floats in total order, ties to the lower position) in one pass against a heap
of the k best, where XLA:CPU partially sorts an index array through value lookups
(4 rows of 2,112 scores, k 256: 0.08-0.10 against 0.29 ms).

Build: the kernel is C++ against the XLA FFI headers that jaxlib ships
(`jax.ffi.include_dir()`), compiled on first use with the machine's C++ compiler
(`$CXX`, else `c++`; `-O3 -march=native`) into `$XDG_CACHE_HOME/jlco/native` (or
`~/.cache/jlco/native`, created 0700), keyed by the source, the jaxlib version, the
compiler (path, size, mtime: not run when the library is cached), the flags and the CPU:
a later process loads it at once. A library (or directory) another user owns, or that
group or others may write, is refused with a warning and XLA's ops run instead: a
library planted there would run inside the engine. A compile is given up after
COMPILE_TIMEOUT_S. `load()` says whether the kernels are usable;
the engine's `engine.cpu_matmul` picks them ("auto": when they build, else XLA's dot with
a warning; "native": required; "xla": never). They are registered for the CPU platform
only and traced under `lax.platform_dependent`, so a program lowered for cuda or tpu
never contains them. The indexer's scores and top-k use the kernels on a CPU backend
wherever they are available (the top-k is `lax.top_k` bit for bit); `$JLCO_NATIVE=0`
turns every kernel off (an A/B switch).

Numerics: each output is one fixed-order sum over k, whatever M, the thread split or the
batch (a request's row does not depend on the rows decoded beside it). `matmul_ref` is
the plain-jnp reference the tests compare against.

May import: the standard library and jax only (the model and the engine import it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

MAX_ROWS = 8          # M the kernels take (kMaxRows in kernels.cc)
SOURCE = pathlib.Path(__file__).with_name("kernels.cc")
TARGETS = {False: "jlco_matmul_nn", True: "jlco_matmul_nt"}   # by `transposed`
TOP_K = "jlco_top_k"
INDEXER_SCORES = "jlco_indexer_scores"
MAX_INDEXER_HEADS = 64   # 8 vectors of lanes on AVX2 (kernels.cc: ScoreFor)
_SYMBOLS = {TARGETS[False]: "JlcoMatmulNn", TARGETS[True]: "JlcoMatmulNt", TOP_K: "JlcoTopK",
            INDEXER_SCORES: "JlcoIndexerScores"}
DISABLE_ENV = "JLCO_NATIVE"      # "0": every kernel off (XLA's ops throughout)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 300   # a compile that takes longer is given up (XLA's ops instead)


class NativeUnavailable(RuntimeError):
    """The kernels could not be built or loaded here (the message says why)."""


def cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "jlco" / "native"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx)
    if path is None:
        raise NativeUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
    return path


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's flags."""
    sig = platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return sig + line
    except OSError:
        pass
    return sig + platform.processor()


def _compiler_signature(cxx: str) -> str:
    """What names the compiler without running it: its resolved path, size and mtime
    (an upgrade or another $CXX changes it), so a cached library costs no subprocess."""
    real = os.path.realpath(cxx)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def _private_dir(path: pathlib.Path) -> None:
    """Create `path` (mode 0700) if missing; refuse one another user owns or that group
    or others may write (a library planted there would run inside this process)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_owned(path, "directory")


def _check_owned(path: pathlib.Path, what: str) -> None:
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise NativeUnavailable(f"refusing the {what} {path}: owned by uid {st.st_uid}, not "
                                f"this user ({os.getuid()}); remove it or set "
                                "$XDG_CACHE_HOME to a directory of your own")
    if st.st_mode & 0o022:
        raise NativeUnavailable(f"refusing the {what} {path}: group- or world-writable "
                                f"(mode {st.st_mode & 0o777:o}); remove it or chmod go-w")


def _build() -> pathlib.Path:
    """The library for this source, jaxlib, compiler, flags and CPU: from the cache when
    present (and owned by this user, not group/world-writable), else compiled into it."""
    cxx = _compiler()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([
        source, importlib.metadata.version("jaxlib").encode(), _compiler_signature(cxx).encode(),
        " ".join(FLAGS).encode(), _cpu_signature().encode()])).hexdigest()[:16]
    out = cache_dir() / f"kernels-{key}.so"
    _private_dir(out.parent)
    if out.exists():
        _check_owned(out, "library")
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = pathlib.Path(tmp) / out.name
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(lib)]
        log.info("jlco.native: compiling %s (%s)", SOURCE.name, " ".join(cmd))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise NativeUnavailable(f"compiling {SOURCE.name} took over {COMPILE_TIMEOUT_S} s "
                                    f"({' '.join(cmd)})") from None
        if done.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} failed ({' '.join(cmd)}): "
                                    f"{done.stderr.strip()[-2000:]}")
        os.chmod(lib, 0o700)
        os.replace(lib, out)      # atomic: concurrent processes each build, one wins
    return out


@functools.cache
def _load() -> pathlib.Path:
    path = _build()
    lib = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in _SYMBOLS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return path


def load() -> pathlib.Path:
    """Build (once per machine) and register the kernels → the library's path; raises
    `NativeUnavailable` saying why when that cannot be done here (or when
    `$JLCO_NATIVE=0` turns the kernels off)."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        raise NativeUnavailable(f"turned off by ${DISABLE_ENV}=0")
    try:
        return _load()
    except NativeUnavailable:
        raise
    except OSError as e:
        raise NativeUnavailable(f"loading the compiled kernels failed: {e}") from e


@functools.cache
def available() -> bool:
    """Whether `load()` succeeds; the first failure is logged as a warning, once.
    `$JLCO_NATIVE=0` turns every kernel off (XLA's ops throughout: an A/B switch)."""
    try:
        load()
        return True
    except NativeUnavailable as e:
        log.warning("jlco.native: CPU kernels unavailable, using XLA's ops (matmuls at "
                    "batch 2-8, the indexer's scores and top-k are slower): %s", e)
        return False


def supports(x: jax.Array, w: jax.Array) -> bool:
    """Whether `linear(x, w)` runs the kernel: f32 operands and at most MAX_ROWS rows."""
    rows = math.prod(x.shape[:-1])
    return x.dtype == jnp.float32 and w.dtype == jnp.float32 and 1 <= rows <= MAX_ROWS


def matmul_ref(x: jax.Array, w: jax.Array, transposed: bool = False,
               precision=jax.lax.Precision.HIGHEST) -> jax.Array:
    """The plain-jnp reference: x [B, M, K] · w [B, K, N] (or [B, N, K] transposed)."""
    spec = "bmk,bnk->bmn" if transposed else "bmk,bkn->bmn"
    return jnp.einsum(spec, x, w, precision=precision)


def batched(x: jax.Array, w: jax.Array, transposed: bool = False) -> jax.Array:
    """x [B, M, K] f32 (M <= MAX_ROWS) · w [B, K, N] f32 ([B, N, K] when `transposed`)
    → [B, M, N] f32 by the native kernel on CPU (`load()` must have succeeded), by
    XLA's dot on other platforms."""
    b, m, _ = x.shape
    n = w.shape[1] if transposed else w.shape[2]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"jlco.native.batched: M={m}, allowed 1..{MAX_ROWS}")
    call = jax.ffi.ffi_call(TARGETS[transposed], jax.ShapeDtypeStruct((b, m, n), jnp.float32),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(
        x, w, cpu=call, default=functools.partial(matmul_ref, transposed=transposed, precision=None))


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] · w [K, N] → [..., N] (the rows of x flattened to one M)."""
    lead = x.shape[:-1]
    y = batched(x.reshape(1, -1, x.shape[-1]), w[None])
    return y.reshape(*lead, w.shape[-1])


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(scores, k)` (f32 scores [..., L], k <= L): the same values and
    positions, by the native kernel on CPU when it is available, else by `lax.top_k`."""
    if (jax.default_backend() != "cpu" or scores.dtype != jnp.float32
            or not 0 <= k <= scores.shape[-1] or not available()):
        return jax.lax.top_k(scores, k)
    out = (jax.ShapeDtypeStruct((*scores.shape[:-1], k), jnp.float32),
           jax.ShapeDtypeStruct((*scores.shape[:-1], k), jnp.int32))
    call = jax.ffi.ffi_call(TOP_K, out, vmap_method="broadcast_all")
    return tuple(jax.lax.platform_dependent(
        scores, cpu=lambda s: tuple(call(s)), default=lambda s: tuple(jax.lax.top_k(s, k))))


def indexer_scores_supported(q: jax.Array, keys: jax.Array) -> bool:
    """Whether `indexer_scores` runs the kernel: on a CPU backend where it is available, f32
    queries, bf16 or f32 keys (fp8 keys with their scales stay with XLA) and at most
    MAX_INDEXER_HEADS heads."""
    return (jax.default_backend() == "cpu" and q.dtype == jnp.float32
            and keys.dtype in (jnp.bfloat16, jnp.float32) and q.shape[2] <= MAX_INDEXER_HEADS
            and available())


def indexer_scores_ref(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """Σ_h w_h · ReLU(q_h · key) [b, s, n] in plain jnp (f32)."""
    hp = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bshd,bnd->bshn", q, keys.astype(jnp.float32), precision=hp)
    return jnp.einsum("bshn,bsh->bsn", jnp.maximum(logits, 0.0), w, precision=hp)


def indexer_scores(q: jax.Array, w: jax.Array, keys: jax.Array) -> jax.Array:
    """The lightning indexer's raw scores Σ_h w_h · ReLU(q_h · key): q [b, s, H, D] f32,
    w [b, s, H] f32, keys [b, n, D] bf16 or f32 → [b, s, n] f32, each a fixed-order sum
    (over d, then heads) that depends only on its query and key (`indexer_scores_supported`
    must hold)."""
    b, s = q.shape[:2]
    call = jax.ffi.ffi_call(INDEXER_SCORES,
                            jax.ShapeDtypeStruct((b, s, keys.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return jax.lax.platform_dependent(q, w, keys, cpu=call, default=indexer_scores_ref)
