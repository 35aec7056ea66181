"""Penalties and biases inside the jitted step (`jlco.sampling.penalties` holds the
request's fields): per batch slot, tables that live on the device beside the KV cache
(`DecodeCache.seen`), seated at admission and counted by every step, so no token's
penalty needs a host round trip and no request compiles anything.

Per step, before the sampler (vLLM's order): min_tokens holds the stop ids back, the
bias is added, then the repetition, frequency and presence penalties. The sampler then
applies temperature, min-p, top-k and top-p. Log-probs are of these logits (after the
penalties and the bias, before temperature and the filters). A row without penalties
keeps its logits bit for bit, and a step whose batch has none skips the work and the
counting (a `lax.cond`), so a batch mixing the two kinds costs what the penalised kind
costs alone.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jlco.sampling.penalties import MAX_HELD_STOPS, MAX_LOGIT_BIAS, Penalties


@partial(jax.tree_util.register_dataclass,
         data_fields=("on", "counts", "prompt", "bias_ids", "bias_vals", "stop_ids",
                      "presence", "frequency", "repetition", "min_tokens"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class SeenTokens:
    """Per batch slot b (V = vocabulary, K = MAX_LOGIT_BIAS, S = MAX_HELD_STOPS): what
    its request's penalties read. Slots whose `on` is False are never read."""
    on: jax.Array          # bool [b] the slot's request has penalties
    counts: jax.Array      # int32 [b, V] times each token was generated so far
    prompt: jax.Array      # bool [b, V] the token is in the prompt
    bias_ids: jax.Array    # int32 [b, K] biased token ids (-1: none)
    bias_vals: jax.Array   # f32 [b, K] their biases
    stop_ids: jax.Array    # int32 [b, S] ids min_tokens holds back (-1: none)
    presence: jax.Array    # f32 [b]
    frequency: jax.Array   # f32 [b]
    repetition: jax.Array  # f32 [b]
    min_tokens: jax.Array  # int32 [b]

    @classmethod
    def zeros(cls, batch: int, vocab: int, xp=jnp) -> "SeenTokens":
        """No slot with penalties (`xp` = np builds a host row for `seat`)."""
        return cls(xp.zeros((batch,), bool), xp.zeros((batch, vocab), np.int32),
                   xp.zeros((batch, vocab), bool), xp.full((batch, MAX_LOGIT_BIAS), -1, np.int32),
                   xp.zeros((batch, MAX_LOGIT_BIAS), np.float32),
                   xp.full((batch, MAX_HELD_STOPS), -1, np.int32),
                   xp.zeros((batch,), np.float32), xp.zeros((batch,), np.float32),
                   xp.ones((batch,), np.float32), xp.zeros((batch,), np.int32))

    @classmethod
    def row(cls, vocab: int, prompt: Sequence[int], generated: Sequence[int],
            p: Penalties, stop_token_ids: Sequence[int] = ()) -> "SeenTokens":
        """One request's tables on the host ([1, ...] numpy), for `seat`."""
        out = cls.zeros(1, vocab, np)
        out.on[0] = p.active
        out.counts[0] = np.bincount(np.asarray(generated, np.int64), minlength=vocab)[:vocab]
        out.prompt[0, np.asarray(prompt, np.int64)] = True
        for i, (t, v) in enumerate(p.logit_bias):
            out.bias_ids[0, i], out.bias_vals[0, i] = t, v
        if p.min_tokens:
            stops = sorted(set(stop_token_ids))
            out.stop_ids[0, :len(stops)] = stops
        out.presence[0], out.frequency[0], out.repetition[0] = p.presence, p.frequency, p.repetition
        out.min_tokens[0] = p.min_tokens
        return out

    @classmethod
    def of_request(cls, vocab: int, req, generated: Sequence[int]) -> "SeenTokens | None":
        """`row` of a scheduler Request that has penalties, None for one without."""
        p = req.params
        if not p.penalties.active:
            return None
        return cls.row(vocab, req.prompt, generated, p.penalties, p.stop_token_ids)


@functools.lru_cache(maxsize=4)
def no_penalties(vocab: int) -> SeenTokens:
    """The host row of a request without penalties (`seat`ed, never read)."""
    return SeenTokens.zeros(1, vocab, np)


def penalize_rows(x, seen: SeenTokens, emitted, counts):
    """x [b, V] f32 → the logits with every `on` row's rules applied (other rows as
    they are, bit for bit); emitted [b]: tokens each row generated before this one;
    counts [b, V]: how often each (`seen.counts`, or more for a speculative position)."""
    b, v = x.shape
    rows = jnp.arange(b)[:, None]
    held = (emitted < seen.min_tokens)[:, None] & (seen.stop_ids >= 0)
    y = x.at[rows, jnp.where(held, seen.stop_ids, v)].set(-jnp.inf, mode="drop")
    y = y.at[rows, jnp.where(seen.bias_ids >= 0, seen.bias_ids, v)].add(seen.bias_vals,
                                                                         mode="drop")
    rep = seen.repetition[:, None]
    generated = counts > 0
    y = jnp.where(seen.prompt | generated, jnp.where(y > 0, y / rep, y * rep), y)
    y = (y - seen.frequency[:, None] * counts.astype(jnp.float32)
         - seen.presence[:, None] * generated.astype(jnp.float32))
    return jnp.where(seen.on[:, None], y, x)


def apply(logits, seen: SeenTokens | None, emitted):
    """logits [b, V] of each slot's next token, emitted [b] (tokens generated before
    it) → the logits the sampler draws from. No tables (None) or no `on` row: as given."""
    if seen is None:
        return logits
    return jax.lax.cond(jnp.any(seen.on),
                        lambda x: penalize_rows(x, seen, emitted, seen.counts),
                        lambda x: x, logits)


def apply_verified(logits, seen: SeenTokens | None, emitted, drafts):
    """logits [b, s, V] of speculative positions, drafts [b, n] (s = n + 1): position j
    is penalised as if drafts 0..j-1 were generated (what it is conditioned on), so an
    accepted draft's distribution is the one plain decoding would have used."""
    if seen is None:
        return logits
    s = logits.shape[1]

    def run(x):
        rows, counts, out = jnp.arange(x.shape[0]), seen.counts, []
        for j in range(s):
            out.append(penalize_rows(x[:, j], seen, emitted + j, counts))
            if j < s - 1:
                counts = counts.at[rows, drafts[:, j]].add(1)
        return jnp.stack(out, axis=1)
    return jax.lax.cond(jnp.any(seen.on), run, lambda x: x, logits)


def count(seen: SeenTokens | None, tokens, n):
    """The tables after a step generated tokens [b, s], the first n [b] of each row
    real (0 for idle slots)."""
    if seen is None:
        return None
    b, s = tokens.shape

    def add(c):
        real = (jnp.arange(s)[None] < n[:, None]).astype(jnp.int32)
        return c.at[jnp.arange(b)[:, None], tokens].add(real, mode="drop")
    return dataclasses.replace(seen, counts=jax.lax.cond(jnp.any(seen.on), add, lambda c: c,
                                                         seen.counts))


def seat(seen: SeenTokens, slot, row: SeenTokens) -> SeenTokens:
    """Slot `slot`'s tables from a host `row` (`SeenTokens.row`); a slot past the batch
    (another data rank's) is dropped."""
    return jax.tree.map(lambda big, small: big.at[slot].set(small[0], mode="drop"), seen, row)


def clear(seen: SeenTokens, slot) -> SeenTokens:
    """Slot `slot` holds a request without penalties (its tables are never read)."""
    return dataclasses.replace(seen, on=seen.on.at[slot].set(False, mode="drop"))
