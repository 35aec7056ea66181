"""Sampling inside the jitted step: the per-slot sampling fields as one pytree, the
filters (temperature, top-k, top-p), the draw, and speculative verification.

`SlotSampling` is built once per step on the host (`from_requests`) and read by the
decode step, the first-token sampler and the speculative verifier alike, so a request's
fields reach every sampler the same way. All randomness of a request's token number i
comes from fold_in(PRNGKey(seed), i): a request draws the same tokens alone or in any
batch, in any slot.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jlco.sampling import constraint, penalize
from jlco.sampling.params import MAX_LOGPROBS


@partial(jax.tree_util.register_dataclass,
         data_fields=("temps", "top_ps", "top_ks", "seeds", "counts", "tops", "min_ps",
                      "constrained", "allowed"),
         meta_fields=())
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Per batch slot: temperature (0 = greedy), top-p (1 = off), top-k (0 = off), the
    request's seed, how many tokens it has emitted (the PRNG index of its next), how
    many alternatives (top log-probs) it wants per token (0 = none), min-p (0 = off)
    and, for a request with a `constraint.TokenConstraint`, its next tokens' bitmask."""
    temps: jax.Array     # f32 [b]
    top_ps: jax.Array    # f32 [b]
    top_ks: jax.Array    # int32 [b]
    seeds: jax.Array     # uint32 [b]
    counts: jax.Array    # int32 [b]
    tops: jax.Array      # int32 [b]
    min_ps: jax.Array    # f32 [b]
    constrained: jax.Array   # bool [b]
    allowed: jax.Array   # int32 [b, ceil(V/32)] (`constraint.apply_mask`)

    @classmethod
    def empty(cls, batch: int, vocab: int) -> "SlotSampling":
        """Every slot greedy, unfiltered, unconstrained (idle slots keep these)."""
        return cls(np.zeros((batch,), np.float32), np.ones((batch,), np.float32),
                   np.zeros((batch,), np.int32), np.zeros((batch,), np.uint32),
                   np.zeros((batch,), np.int32), np.zeros((batch,), np.int32),
                   np.zeros((batch,), np.float32),
                   *constraint.host_masks((), batch, vocab, ()))

    @classmethod
    def from_requests(cls, requests: Sequence, batch: int, vocab: int,
                      slots: Sequence[int] | None = None,
                      counts: Sequence[int] | None = None) -> "SlotSampling":
        """The `params` (`SamplingParams`) of `requests` at their slots (`slots`,
        default each request's `.slot`), counts default len(request.tokens); constrained
        requests' masks as their constraints stand now."""
        slots = [r.slot for r in requests] if slots is None else slots
        out = cls.empty(batch, vocab)
        held = [r.params.constraint for r in requests]
        if any(c is not None for c in held):     # else empty()'s zero masks stand
            on, allowed = constraint.host_masks(held, batch, vocab, slots)
            out = dataclasses.replace(out, constrained=on, allowed=allowed)
        for i, (r, s) in enumerate(zip(requests, slots)):
            p = r.params
            out.temps[s], out.top_ps[s], out.top_ks[s] = p.temperature, p.top_p, p.top_k
            out.seeds[s], out.tops[s], out.min_ps[s] = p.seed, p.top_logprobs, p.min_p
            out.counts[s] = len(r.tokens) if counts is None else counts[i]
        return out

    def keys(self, offset: jax.Array | int = 0) -> jax.Array:
        """Sampling keys [b, 2] of each slot's token number counts + offset."""
        return request_keys(self.seeds, self.counts + offset)

    def repeat(self, s: int) -> "SlotSampling":
        """Each slot's fields s times ([b] → [b * s]), for s positions per slot."""
        return jax.tree.map(lambda x: jnp.repeat(x, s, axis=0), self)


def request_keys(seeds, counts):
    """Sampling keys [b, 2] of token number counts[b] of the requests seeded seeds[b]
    (uint32): the same values as `fold_in(PRNGKey(seed), count)` on the host, derived
    inside the step so the host does no per-request jax work."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counts)


def sample_key(seed: int, count: int) -> np.ndarray:
    """The sampling key of a request's token number `count` (0 = the prefill's token)."""
    return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), count))


def sampling_logits(logits, temps, top_ps, top_ks, min_ps=None):
    """The logits a sampled row draws from: logits [b, V] f32 divided by the row's
    temperature (temps [b], 0 = greedy rows are left untempered), then min-p (min_ps
    [b], 0 = off: tokens less likely than min_p times the most likely one), top-k
    (top_ks [b] int32, 0 = off) and top-p (top_ps [b], 1 = off; nucleus over the
    top-k-renormalised distribution), in vLLM's order, set to -inf outside the kept set
    (ties with the last kept value are kept). The sort over the vocabulary runs only
    when some row filters."""
    scaled = logits / jnp.where(temps > 0, temps, 1.0)[:, None]
    v = logits.shape[-1]
    min_ps = jnp.zeros_like(temps) if min_ps is None else min_ps

    def filtered(x):
        floor = jnp.max(x, axis=-1, keepdims=True) + jnp.log(min_ps)[:, None]
        x = jnp.where((min_ps > 0)[:, None] & (x < floor), -jnp.inf, x)
        desc = -jnp.sort(-x, axis=-1)                                   # [b, V]
        k = jnp.where(top_ks > 0, jnp.minimum(top_ks, v), v)
        idx = jnp.arange(v)[None]
        in_k = jnp.where(idx < k[:, None], desc, -jnp.inf)
        probs = jax.nn.softmax(in_k, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs                     # mass above each
        n_p = jnp.where(top_ps < 1.0,
                        jnp.maximum(jnp.sum(before < top_ps[:, None], axis=-1), 1), v)
        keep = jnp.minimum(k, n_p)
        thresh = jnp.take_along_axis(desc, (keep - 1)[:, None], axis=-1)
        # Rows that filter nothing keep their logits bit for bit (a row samples the same
        # alone as beside rows that filter).
        return jnp.where(row_filters[:, None] & (x < thresh), -jnp.inf, x)

    row_filters = (temps > 0) & ((top_ks > 0) | (top_ps < 1.0) | (min_ps > 0))
    return jax.lax.cond(jnp.any(row_filters), filtered, lambda x: x, scaled)


def draw(logits, temps, keys, top_ps, top_ks, min_ps=None):
    """logits [b, V] → (tokens int32 [b], the filtered logits [b, V]): greedy rows take
    the argmax, sampled rows draw from `sampling_logits` with their key."""
    flat = sampling_logits(logits, temps, top_ps, top_ks, min_ps)
    # The draw (Gumbel noise over the vocabulary) only when some row samples: an
    # all-greedy batch skips it (0.2 ms of a 7 ms step at batch 1, vocab 2048, on CPU).
    drawn = jax.lax.cond(jnp.any(temps > 0),
                         lambda f: jax.vmap(jax.random.categorical)(keys, f).astype(jnp.int32),
                         lambda f: jnp.zeros(f.shape[:1], jnp.int32), flat)
    return jnp.where(temps > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32), flat


def token_logprobs(logits, tokens):
    """log-softmax of the untempered, unfiltered logits [..., V] at tokens [...]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def sample_rows(logits, temps, keys, top_ps=None, top_ks=None, min_ps=None):
    """logits [b, V] f32, temps [b], keys [b, 2], top_ps [b] (default 1 = off), top_ks
    [b] int32 (default 0 = off), min_ps [b] (default 0 = off) → (tokens [b], logprobs
    [b]); temp 0 = greedy (the filters ignored); the log-prob is of the untempered,
    unfiltered distribution (what `--json` reports)."""
    b = logits.shape[0]
    top_ps = jnp.ones((b,), jnp.float32) if top_ps is None else top_ps
    top_ks = jnp.zeros((b,), jnp.int32) if top_ks is None else top_ks
    tok, _ = draw(logits, temps, keys, top_ps, top_ks, min_ps)
    return tok, token_logprobs(logits, tok)


def sample(logits, sampling: SlotSampling, seen=None):
    """logits [b, V] → (tokens [b], (log-probs [b], alternatives `top_alternatives`))
    with each slot's own fields, after its penalties (`seen`: the slots' penalty tables,
    `jlco.sampling.penalize`; None: none) and within its constraint's mask."""
    logits = constraint.apply_mask(logits, sampling.constrained, sampling.allowed)
    logits = penalize.apply(logits, seen, sampling.counts)
    tok, logp = sample_rows(logits, sampling.temps, sampling.keys(), sampling.top_ps,
                            sampling.top_ks, sampling.min_ps)
    return tok, (logp, *top_alternatives(logits, sampling.tops))


def top_alternatives(logits, tops):
    """The MAX_LOGPROBS most likely ids and their log-probs [..., K] of logits [..., V]
    (the untempered distribution), computed only when some row wants any (tops [b] > 0;
    a `lax.cond`, so a batch without such requests pays nothing and none recompiles);
    zeros otherwise."""
    k = min(MAX_LOGPROBS, logits.shape[-1])

    def top(x):
        lps, ids = jax.lax.top_k(jax.nn.log_softmax(x.astype(jnp.float32), axis=-1), k)
        return ids.astype(jnp.int32), lps

    def none(x):
        return (jnp.zeros(x.shape[:-1] + (k,), jnp.int32),
                jnp.zeros(x.shape[:-1] + (k,), jnp.float32))
    return jax.lax.cond(jnp.any(tops > 0), top, none, logits)


@partial(jax.jit, static_argnames=("k",))
def position_logprobs(logits, next_tokens, *, k: int = MAX_LOGPROBS):
    """logits [n, V] of n positions, next_tokens [n] → (each next token's log-prob [n],
    the k most likely ids [n, k] and their log-probs [n, k]): the untempered, unfiltered
    distribution, as `token_logprobs` (what vLLM's logprobs_mode "raw_logprobs" reports)."""
    logp = jax.nn.log_softmax(logits.reshape(-1, logits.shape[-1]).astype(jnp.float32), -1)
    lp = jnp.take_along_axis(logp, next_tokens.reshape(-1)[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, min(k, logits.shape[-1]))
    return lp, top_ids.astype(jnp.int32), top_lp


# A prefill's first token, compiled once (called eagerly, `sample_rows`' lax.cond would
# be traced and compiled again for every request).
sample_first = jax.jit(sample)


def first_token(logits, request) -> tuple[int, float, list[tuple[int, float]]]:
    """A request's token number 0 from the logits [1, V] at its last prompt position,
    after its penalties (the prompt's tokens for the repetition penalty, the bias,
    min_tokens) → (token, log-prob, its `params.top_logprobs` alternatives)."""
    v = logits.shape[-1]
    seen = penalize.SeenTokens.of_request(v, request, ()) or penalize.no_penalties(v)
    sampling = SlotSampling.from_requests([request], 1, logits.shape[-1], slots=[0], counts=[0])
    tok, (logp, ids, lps) = sample_first(logits.astype(jnp.float32), sampling, seen)
    k = request.params.top_logprobs
    alts = [(int(i), float(v)) for i, v in zip(ids[0, :k], lps[0, :k])] if k else []
    return int(tok[0]), float(logp[0]), alts


def rejection_accept(logits, drafts, keys):
    """Speculative sampling of one request's verified positions against point-mass
    drafts. logits [s, V]: position j's sampling logits (`sampling_logits`: -inf outside
    the kept set), s = n + 1; drafts int32 [n]: d_{j+1}, proposed for position j; keys
    [s, 2]: position j's key. → (tokens int32 [s], accept bool [n]): draft j+1 is
    accepted with probability p_j(d) (a uniform drawn with split(key_j)[0]); token j < n
    is d_{j+1} if accepted, else a draw from p_j without d (the residual, drawn with
    split(key_j)[1], independent of the uniform); token n is a draw from p_n with key_n
    itself (the bonus token: the draw "per_token" and plain sampling make). The caller
    emits tokens 0..a, a = leading accepts: each is distributed as p_j, and each token
    number's key serves one emitted token (a later step starts after them)."""
    n = drafts.shape[0]
    rows = jnp.arange(n)
    split = jax.vmap(jax.random.split)(keys[:n])                          # [n, 2, 2]
    p_draft = jnp.exp(jax.nn.log_softmax(logits[:n], axis=-1)[rows, drafts])
    accept = jax.vmap(jax.random.uniform)(split[:, 0]) < p_draft
    # p_j(d) == 1 leaves the residual empty, but then u < 1 always accepts.
    residual = logits[:n].at[rows, drafts].set(-jnp.inf)
    redrawn = jax.vmap(jax.random.categorical)(split[:, 1], residual)
    bonus = jax.random.categorical(keys[n], logits[n])
    tokens = jnp.concatenate([jnp.where(accept, drafts, redrawn), bonus[None]])
    return tokens.astype(jnp.int32), accept


def verify(logits, drafts, sampling: SlotSampling, rule: str, seen=None):
    """logits [b, s, V] of the verified positions, drafts [b, n] (s = n + 1) → (tokens
    int32 [b, s], (their log-probs [b, s], alternatives [b, s, K] x 2), leading accepted
    drafts [b]) before the cap on tokens left; each position after its penalties
    (`penalize.apply_verified`, with `seen` the slots' tables). Greedy rows: argmax,
    accepted while equal; sampled rows: "per_token" draws with the non-speculative key
    and accepts while equal, "rejection" uses `rejection_accept`. A constrained row's
    first position is masked (`constraint.apply_mask`) and its drafts are not accepted.
    With n = 0 this is `sample` (one position, nothing to accept)."""
    first = constraint.apply_mask(logits[:, 0], sampling.constrained, sampling.allowed)
    logits = penalize.apply_verified(logits.at[:, 0].set(first), seen, sampling.counts, drafts)
    b, s, v = logits.shape
    keys = jax.vmap(lambda seed, c: jax.vmap(
        lambda j: jax.random.fold_in(jax.random.PRNGKey(seed), c + j))(jnp.arange(s)))(
        sampling.seeds, sampling.counts)                                   # [b, s, 2]
    rep = sampling.repeat(s)
    tok, flat = draw(logits.reshape(b * s, v), rep.temps, keys.reshape(b * s, -1),
                     rep.top_ps, rep.top_ks, rep.min_ps)
    tok = tok.reshape(b, s)
    accept = drafts == tok[:, :s - 1]
    if rule == "rejection" and s > 1:
        rej_tok, rej_accept = jax.vmap(rejection_accept)(flat.reshape(b, s, v), drafts, keys)
        sampled = sampling.temps > 0
        tok = jnp.where(sampled[:, None], rej_tok, tok)
        accept = jnp.where(sampled[:, None], rej_accept, accept)
    accepted = jnp.cumprod(accept.astype(jnp.int32), axis=1).sum(axis=1)
    accepted = jnp.where(sampling.constrained, 0, accepted)
    return tok, (token_logprobs(logits, tok), *top_alternatives(logits, sampling.tops)), accepted
