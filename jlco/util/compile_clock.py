"""Seconds JAX spends tracing, lowering and compiling, from its monitoring events: what a
timed run subtracts to report its steady state, and reports beside it (a user waits for
both)."""

from __future__ import annotations

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


class CompileClock:
    """`total`: seconds of tracing, lowering and compiling since it was made; `compiles`:
    backend compilations (a program loaded from the persistent cache counts too: XLA
    still builds its executable)."""

    def __init__(self):
        import jax
        self.total = 0.0
        self.compiles = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.total += duration
        if event == BACKEND_COMPILE:
            self.compiles += 1
