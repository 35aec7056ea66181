"""The seeded random-weight model, kept beside JAX's persistent compilation cache.

Building `DeepseekV32(cfg, rngs=nnx.Rngs(seed))` runs every initialiser op by op: about
50 tiny XLA programs (one per parameter shape and op), ~5 s of compilation cold and
~0.7 s warm on a 2-core CPU for configs/tiny.py, most of a warm `jlco.generate`'s model
setup. The arrays are a pure function of the key below (model config, seed, the model
code's source, jax / jaxlib / flax versions and the PRNG settings), so once built they
are written to `<compilation cache>/random_models/<key>.npz`; a later process traces only
the module tree (`nnx.eval_shape`, no compilation) and reads them: the same bits as
building eagerly (~0.3 s).

Only while the compilation cache is on (the entry points call `compile_cache.enable()`)
and for models of at most MAX_BYTES; anything unreadable is rebuilt (a cache is an
optimisation, never an error).
"""

from __future__ import annotations

import hashlib
import io
import pathlib

MAX_BYTES = 64 << 20
_MODEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "model"


def store_dir() -> pathlib.Path | None:
    """`random_models/` in the compilation cache jax uses now; None when it is off."""
    import jax
    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return pathlib.Path(jax.config.jax_compilation_cache_dir) / "random_models"


def store_key(mcfg, seed: int) -> str:
    import flax
    import jax
    import jaxlib
    h = hashlib.sha256()
    for part in (repr(mcfg), str(seed), jax.__version__, jaxlib.__version__, flax.__version__,
                 str(jax.config.jax_default_prng_impl),
                 str(jax.config.jax_threefry_partitionable)):
        h.update(part.encode() + b"\0")
    sources = sorted(_MODEL_DIR.glob("*.py"))
    if mcfg.model_type == "deepseek_v4":
        sources += sorted((_MODEL_DIR / "deepseek_v4").glob("*.py"))
    for src in sources:
        h.update(str(src.relative_to(_MODEL_DIR)).encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:32]


def random_model(mcfg, seed: int):
    """`DeepseekV32(mcfg, rngs=nnx.Rngs(seed))` (a deepseek_v4 `mcfg`: `DeepseekV4`),
    read from the store when it is there."""
    from flax import nnx

    def build():
        if mcfg.model_type == "deepseek_v4":
            from jlco.model.deepseek_v4.model import DeepseekV4
            return DeepseekV4(mcfg, rngs=nnx.Rngs(seed))
        from jlco.model.decoder import DeepseekV32
        return DeepseekV32(mcfg, rngs=nnx.Rngs(seed))

    where = store_dir()
    if where is None:
        return build()
    path = where / f"{store_key(mcfg, seed)}.npz"
    model = _load(path, nnx.eval_shape(build)) if path.is_file() else None
    if model is None:
        model = build()
        _save(path, model)
    return model


def _load(path: pathlib.Path, abstract):
    """The abstract model's leaves filled from `path`, or None if it does not fit."""
    import jax
    import numpy as np
    from flax import nnx
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)
    try:
        with np.load(path) as f:
            raw = [f[str(i)] for i in range(len(leaves))]
    except (OSError, KeyError, ValueError):
        return None
    arrays = []
    for leaf, r in zip(leaves, raw):
        dtype = np.dtype(leaf.dtype)
        if r.dtype != np.uint8 or r.size != dtype.itemsize * int(np.prod(leaf.shape)):
            return None
        arrays.append(jax.numpy.asarray(r.view(dtype).reshape(leaf.shape)))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))


def _save(path: pathlib.Path, model) -> None:
    import jax
    import numpy as np
    from flax import nnx

    from jlco.util import atomic
    leaves = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    if sum(x.nbytes for x in leaves) > MAX_BYTES:
        return
    buf = io.BytesIO()
    np.savez(buf, **{str(i): np.ascontiguousarray(x).reshape(-1).view(np.uint8)
                     for i, x in enumerate(leaves)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes(path, buf.getvalue())
    except OSError:
        pass
