"""JAX's persistent compilation cache, on by default for every jlco entry point that
compiles (generate, convert, tools/tune.py): a second run of the same shapes loads the
executables from disk instead of recompiling (the tiny model's `generate` goes from
~14 s to ~5 s on a 2-core CPU).

Location: `$JLCO_COMPILATION_CACHE_DIR` if set (the empty string disables the cache),
else `$XDG_CACHE_HOME/jlco/jax`, else `~/.cache/jlco/jax`. Every compile is cached
(minimum compile time 0 s): the tiny model's compiles take well under jax's default 1 s
threshold, and CPU startup is dominated by many small ones. The seeded random-weight
model is kept beside the executables (`jlco.checkpoint.random_store`): its op-by-op init
is ~50 of those small compilations.

Call `enable()` before the first compilation. It imports only the standard library: if
jax is already loaded it updates `jax.config` (through `sys.modules`), and it always sets
jax's environment variables, so a jax imported later, or a child process, agrees.
"""

from __future__ import annotations

import os
import pathlib
import sys

ENV_VAR = "JLCO_COMPILATION_CACHE_DIR"
MIN_COMPILE_TIME_S = 0.0


def cache_dir() -> pathlib.Path | None:
    """Where the cache lives, or None when `$JLCO_COMPILATION_CACHE_DIR` is ''."""
    env = os.environ.get(ENV_VAR)
    if env is not None:
        return pathlib.Path(env).expanduser() if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "jlco" / "jax"


def enable() -> pathlib.Path | None:
    """Turn the persistent cache on (or off, for an empty `$JLCO_COMPILATION_CACHE_DIR`);
    returns the directory used, None when disabled or when it cannot be created (then
    compilation simply is not cached: a cache is an optimisation, never an error)."""
    path = cache_dir()
    if path is not None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            path = None
    settings = {"jax_enable_compilation_cache": path is not None,
                "jax_compilation_cache_dir": str(path) if path is not None else None,
                "jax_persistent_cache_min_compile_time_secs": MIN_COMPILE_TIME_S}
    for name, value in settings.items():
        key = name.upper()
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value).lower() if isinstance(value, bool) else str(value)
    jax = sys.modules.get("jax")
    if jax is not None:
        for name, value in settings.items():
            jax.config.update(name, value)
    return path
