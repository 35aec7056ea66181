"""What the runner hands a decode step and gets back: the per-slot step inputs (one
registered pytree, built in one place from the running requests) and a step's output
per request."""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
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
                      last: Sequence[int] | int = 1, width: int | None = None,
                      ahead: Sequence[bool] | None = None) -> "StepInputs":
        """`running` at their slots; each slot's tokens are the request's last `last`
        (one count, or one per request) tokens, left-aligned in a [b, width] row
        (default width: the largest count); vocab: the model's (constraint masks).
        ahead (one per request, default none): the request's last token is still being
        computed by a step in flight, so its row is left 0 for the device to fill
        (`follow_tokens`) and its counts are one further on."""
        last = [last] * len(running) if isinstance(last, int) else list(last)
        ahead = [False] * len(running) if ahead is None else [bool(a) for a in ahead]
        width = max(last, default=1) if width is None else width
        tokens = np.zeros((batch, width), np.int32)
        active = np.zeros((batch,), bool)
        limit = np.zeros((batch,), np.int32)
        for r, k, a in zip(running, last, ahead):
            if not a:
                tokens[r.slot, :k] = r.tokens[-k:]
            active[r.slot] = True
            limit[r.slot] = r.max_new_tokens - len(r.tokens) - a
        counts = [len(r.tokens) + a for r, a in zip(running, ahead)]
        return cls(tokens, active, SlotSampling.from_requests(running, batch, vocab,
                                                              counts=counts), limit)


def follow_tokens(prev: jax.Array, tokens: jax.Array, ahead: jax.Array) -> jax.Array:
    """A step's input tokens [b, 1]: prev [b] (the tokens the step in flight samples)
    where ahead [b], else tokens (the host's)."""
    return jnp.where(ahead[:, None], prev[:, None].astype(tokens.dtype), tokens)


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
