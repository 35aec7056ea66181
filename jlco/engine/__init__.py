"""The engine wing: `scheduler` (pure Python, no jax: requests, waiting queue, slots,
pages, admission, abort, finish and stop conditions; it decides what runs each step),
`runner` (model state, device caches, hot buffers and jitted steps; executes a plan),
`core.Engine` (joins the two: submit / step / abort / run), `steps` (the jitted step
functions), `host_driven` (the host-driven fetch path), `speculative` (MTP drafts +
greedy-exact verification) and `synthetic` (PD-style synthetic prefilled contexts).

May import: everything below it (`jlco.model`, `jlco.offload`, `jlco.pallas` (the
kernel choice), `jlco.parallel` (the mesh), `jlco.config`, `jlco.planning.trace`,
`jlco.util`); nothing above (the server, entry points, tools). This file imports nothing
eagerly so that `jlco.engine.scheduler` loads without jax; `from jlco.engine import
Engine` works through the lazy lookup below.
"""

_LAZY = {"Engine": "core", "Request": "scheduler", "RequestError": "scheduler"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"jlco.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jlco.engine' has no attribute {name!r}")
