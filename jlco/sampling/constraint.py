"""Constrained decoding: which tokens a request may take next, as a bitmask the jitted
sampler applies on the device.

A request may carry a `TokenConstraint` (structured outputs: `jlco.structured` builds
them from JSON schemas, regexes, choices and grammars). Before each step the host asks
every constrained request in the batch for its mask (`fill`, one bit per vocabulary id,
packed in int32 words as llguidance and vLLM pack them) and after the step tells it the
token it took (`consume`, from `Scheduler.append`). The step sets every masked-out id's
logit to -inf before the penalties, so greedy, sampled and log-probs all see the
constrained distribution; rows without a constraint keep their logits bit for bit and a
batch without any skips the work (a `lax.cond`). The mask has a fixed shape [b,
ceil(V/32)], so no request compiles anything.

With speculative decoding a constrained row takes no drafts: its first verified position
is masked and sampled, the drafts after it are not accepted (their masks would depend on
tokens only the device knows), so every emitted token obeys the grammar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class TokenConstraint:
    """What the engine asks of a constraint (implemented by `jlco.structured.Grammar`)."""

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row (int32 [ceil(V/32)]): bit i of word w
        set = token 32 w + i allowed."""
        raise NotImplementedError

    def consume(self, token: int) -> None:
        """The request took `token` (one the last mask allowed)."""
        raise NotImplementedError

    @property
    def stopped(self) -> bool:
        """The constraint is complete and allows nothing more: the request ends ("stop")."""
        raise NotImplementedError


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


def host_masks(constraints, batch: int, vocab: int, slots) -> tuple[np.ndarray, np.ndarray]:
    """(constrained bool [b], allowed int32 [b, ceil(V/32)]) of the constraints (None
    for none) at `slots`; all-zero masks (never read) when none is constrained."""
    on = np.zeros((batch,), bool)
    allowed = np.zeros((batch, mask_words(vocab)), np.int32)
    for c, s in zip(constraints, slots):
        if c is not None:
            on[s] = True
            c.fill(allowed[s])
    return on, allowed


def apply_mask(logits, constrained, allowed):
    """logits [b, V] → -inf where a constrained row's mask (allowed int32 [b, W]) has the
    id's bit clear; unconstrained rows as given."""
    v = logits.shape[-1]

    def masked(x):
        # Unpacked by a broadcast shift (no gather): [b, W, 32] → [b, 32 W] → [b, V].
        shifts = jnp.arange(32, dtype=jnp.int32)
        bits = ((allowed[:, :, None] >> shifts) & 1).reshape(allowed.shape[0], -1)[:, :v]
        return jnp.where(constrained[:, None] & (bits == 0), -jnp.inf, x)
    return jax.lax.cond(jnp.any(constrained), masked, lambda x: x, logits)
