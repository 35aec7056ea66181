"""What the runner hands a decode step and gets back: the per-slot step inputs (one
registered pytree, built in one place from the running requests) and a step's output
per request."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import numpy as np

from jlco.sampling.sample import SlotSampling


@partial(jax.tree_util.register_dataclass,
         data_fields=("tokens", "active", "sampling", "limit"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What one decode step takes per batch slot, built in one place (`from_requests`)
    and read by the step, its sampler and the speculator alike."""
    tokens: jax.Array          # int32 [b, s] the last emitted token(s), not yet cached
    active: jax.Array          # bool [b] the slot holds a running request
    sampling: SlotSampling     # temperature, filters, seed and token count per slot
    limit: jax.Array           # int32 [b] tokens the request may still emit

    @classmethod
    def from_requests(cls, running: Sequence, batch: int, vocab: int,
                      last: Sequence[int] | int = 1, width: int | None = None) -> "StepInputs":
        """`running` at their slots; each slot's tokens are the request's last `last`
        (one count, or one per request) tokens, left-aligned in a [b, width] row
        (default width: the largest count); vocab: the model's (constraint masks). A
        step queued behind another replaces the rows of the requests in flight on the
        device (`jlco.engine.decode.follow_inputs`)."""
        last = [last] * len(running) if isinstance(last, int) else list(last)
        width = max(last, default=1) if width is None else width
        tokens = np.zeros((batch, width), np.int32)
        active = np.zeros((batch,), bool)
        limit = np.zeros((batch,), np.int32)
        for r, k in zip(running, last):
            tokens[r.slot, :k] = r.tokens[-k:]
            active[r.slot] = True
            limit[r.slot] = r.max_new_tokens - len(r.tokens)
        return cls(tokens, active, SlotSampling.from_requests(running, batch, vocab), limit)


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    """One decode step: per decoded request (in the order given), the tokens it emitted
    (1, or up to 1 + drafts with speculative decoding) and their log-probs; with
    speculative decoding also the drafts proposed for it and how many were accepted."""
    tokens: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    seconds: float
    drafted: tuple[int, ...] = ()
    wait_seconds: float = 0.0           # of `seconds`, blocked waiting for the device
    accepted: tuple[int, ...] = ()
    # Per decoded request, per emitted token: its alternatives [(id, log-prob), ...]
    # (the request's top_logprobs many; empty when it asked for none).
    top: tuple = ()


def alternatives(ids, lps, k: int) -> list[tuple[int, float]]:
    """The first k of one position's top ids [K] and log-probs [K] as pairs."""
    return [(int(i), float(v)) for i, v in zip(ids[:k], lps[:k])]
