"""The engine wing: `scheduler` (pure Python, no jax: requests, waiting queue, slots,
pages, admission, abort, finish and stop conditions, the one request check; it decides
what runs each step), `runner` (model state, device caches, prefills; executes a plan),
`core.Engine` (joins the two: submit / step / abort / run, and what the server asks;
`disagg` its PD half), `decode` (the one decode step: drafts, fetch strategy, mesh
binding and async following as independent options), `steps` (the step's jitted
pieces: open_step / model / close_step, install, warm-up), `inputs` (the per-step input
pytree, the step's output), `overlap` (async scheduling's queue), `host_driven` (the
host-driven fetch strategy: the step as phases, its host pool), `speculative` (MTP
drafts, the verify seam), `allocation` (cache allocation and sizing), `prefill`
(prefill jobs, which one runs next), `prefix` (prefix reuse), `warmup` (every prefill
and decode shape compiled before serving), `transfer` (PD wire format) and `synthetic`
(PD-style contexts).

May import: everything below it (`jlco.model`, `jlco.offload`, `jlco.pallas` (the
kernel choice), `jlco.parallel` (the mesh), `jlco.sampling` (request parameters, the
draw), `jlco.config`, `jlco.planning.trace`, `jlco.util`); nothing above (the server,
entry points, tools). This file imports nothing eagerly so that `jlco.engine.scheduler`
loads without jax; `from jlco.engine import Engine` works through the lazy lookup below.
"""

_LAZY = {"Engine": "core", "Request": "scheduler", "RequestError": "scheduler"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"jlco.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jlco.engine' has no attribute {name!r}")
