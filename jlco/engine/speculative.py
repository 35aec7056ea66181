"""Speculative decoding in the engine: drafts from the MTP layer (or a given list),
verified by one s_q = 1 + n forward of the main model, accepted greedily-exact.

One engine step, per request with main-cache length L (x_0..x_{L-1} cached, x_L the
last emitted token, not yet cached), all inside ONE jit:

  1. draft   `Drafter.propose` → d_1..d_n. The MTP drafter first catches its own cache
             layer up: positions whose main hidden h_p came out of the previous step
             (P..L-1, 1..n+1 of them, ragged) run through the MTP block with the token
             that follows each (x_{p+1}); the last one, (h_{L-1}, x_L), predicts d_1.
             Then it chains, as DeepSeek/vLLM do: (its own block output at L-1, d_1) at
             position L predicts d_2, and so on.
  2. verify  tokens [x_L, d_1..d_n] at positions L..L+n → logits; position j's token
             (the request's token number len(tokens)+j) comes from logits[j]: at
             temperature 0 the argmax, and draft j+1 is accepted while it equals it; at
             temperature > 0 see below.
  3. emit    target 0..a (a accepted drafts + the bonus token), never more than the
             request has left (max_new_tokens); lengths roll back to L + a + 1.

Rejected positions need no cleanup: every cache seam writes by position, a later
forward rewrites position p before any query at p or later reads it (writes come
before the indexer in every layer), and queries never see positions past their own.
Offloaded, the rewrite lands in the host pool (scatter by row id) and in the hot buffer
(`insert_slots` maps a resident position to its slot, so its bytes are overwritten).

MTP attention context (checked against references): `transformers` does not run the MTP
layer at all (DeepSeek-V3/V3.2 list `model.layers.61.*` as unexpected keys); vLLM and
SGLang give the MTP block its own KV cache layer (for V3.2 also its own indexer keys)
covering every position of the sequence: the drafter runs over all prompt positions
during prefill and over the accepted positions after each verification. jlco does the
same in cache layer `num_hidden_layers`: the row at position p comes from (h_p, x_{p+1}),
written per prefill chunk and by the catch-up of step 1. Deviation: vLLM zeroes the
token embedding at position 0; `DeepseekV32.mtp_logits` does not (model-owned).

Temperature > 0 (`engine.spec_sampling`): p_j is the softmax of position j's logits
after the request's temperature, top-k and top-p (`sampling.sampling_logits`); all the
randomness of the token number i = len(tokens)+j comes from fold_in(PRNGKey(seed), i),
so a request draws the same tokens alone or in any batch, in any slot.
  "rejection"  speculative sampling (Leviathan et al.; vLLM's rejection sampler with
               draft probabilities absent): drafts are argmaxes, so q_j is a point mass
               at d_{j+1} and draft j+1 is accepted with probability
               min(1, p_j(d)/q_j(d)) = p_j(d), in order until the first rejection; a
               rejection at j emits a draw from the residual max(0, p_j - q_j)
               renormalised (p_j without d), and after n acceptances the bonus token is
               drawn from p_n (`rejection_accept`). Every emitted token is distributed
               exactly as non-speculative sampling's, but the random bits are used
               differently, so the tokens are not the non-speculative engine's.
  "per_token"  every position is drawn from p_j with the key non-speculative sampling
               uses for that token number, and a draft is accepted while it equals the
               draw: the emitted sequence is the non-speculative one token for token (up
               to float summation order).
With point-mass drafts both accept draft j+1 with the same probability p_j(d) (a draw
from p_j equals d that often) and emit the same residual on rejection: the two rules are
the same process on different random bits; `rejection` gains over `per_token` only for
a drafter that samples (q not a point mass), which none here does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlco.engine.inputs import StepInputs
from jlco.engine.steps import close_step, open_step
from jlco.model.kv_cache import prefill_scan
from jlco.model.prefill import mtp_followers, mtp_rows
from jlco.sampling import penalize
from jlco.sampling.sample import verify


class DraftInputs(NamedTuple):
    """What a drafter sees inside the jitted step (n drafts, b batch slots, d hidden)."""
    pend_h: jax.Array       # [b, n+1, d] main final-normed hidden at positions L-pend_n..L-1
    pend_tok: jax.Array     # int32 [b, n+1] the token after each of those positions
    pend_n: jax.Array       # int32 [b] how many of them are real (1..n+1)
    host_drafts: jax.Array  # int32 [b, n] drafts proposed on the host (`Drafter.host_drafts`)


class Drafter:
    """Where draft tokens come from. `propose` runs traced inside the engine's jitted
    step and is compiled once per `propose` function, so it must read no per-instance
    state; `host_drafts` runs on the host before each step (for drafters that know
    tokens the device does not). `needs_mtp_cache`: the engine fills the MTP layer's
    cache rows during prefill only for drafters that read them."""
    needs_mtp_cache = False

    def __eq__(self, other):
        """Only `propose` is traced (per-instance state lives on the host), so drafters
        with the same `propose` share one compiled step across engines."""
        return isinstance(other, Drafter) and type(self).propose is type(other).propose

    def __hash__(self):
        return hash(type(self).propose)

    def host_drafts(self, slots: Sequence, n: int) -> np.ndarray:
        """slots: the engine's batch slots (Request or None) → int32 [b, n]; −1 = none."""
        return np.full((len(slots), n), -1, np.int32)

    def propose(self, model, cache, inputs: DraftInputs, *, n: int, impl: str):
        """→ (drafts int32 [b, n], cache)."""
        raise NotImplementedError


class MTPDrafter(Drafter):
    """DeepSeek MTP: (h_i, emb(x_{i+1})) → x_{i+2}, chained on its own hidden. A
    subclass may override `host_drafts` to replace MTP drafts where it gives one (>= 0),
    e.g. from a prompt-lookup hint; the chain still runs on the MTP's own drafts."""
    needs_mtp_cache = True

    def propose(self, model, cache, inputs: DraftInputs, *, n: int, impl: str):
        b = inputs.pend_n.shape[0]
        rows = jnp.arange(b)
        start = cache.lengths - inputs.pend_n
        with jax.named_scope("mtp_catch_up"):
            logits, x, cache = model.mtp_logits(inputs.pend_h, inputs.pend_tok, cache, start,
                                                impl=impl)
        last = inputs.pend_n - 1
        draft = jnp.argmax(logits[rows, last], axis=-1).astype(jnp.int32)
        hx, drafts = x[rows, last], [draft]
        for j in range(1, n):
            with jax.named_scope(f"mtp_chain_{j}"):
                logits, x, cache = model.mtp_logits(hx[:, None], draft[:, None], cache,
                                                    cache.lengths + j - 1, impl=impl)
            draft = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            hx = x[:, 0]
            drafts.append(draft)
        host = inputs.host_drafts
        return jnp.where(host >= 0, host, jnp.stack(drafts, axis=1)), cache


class ListDrafter(Drafter):
    """Proposes tokens a host function gives: `proposals(request, n)` → up to n token
    ids (padded with 0). Tests use it as an oracle (the true continuation) or a
    deliberately wrong one to exercise acceptance."""

    def __init__(self, proposals: Callable[[object, int], Sequence[int]]):
        self.proposals = proposals

    def host_drafts(self, slots, n):
        out = np.zeros((len(slots), n), np.int32)
        for i, req in enumerate(slots):
            if req is not None:
                got = [int(t) for t in self.proposals(req, n)][:n]
                out[i, :len(got)] = got
        return out

    def propose(self, model, cache, inputs, *, n, impl):
        return jnp.maximum(inputs.host_drafts, 0), cache


@dataclasses.dataclass
class SpecMetrics:
    """Counts over request-steps (one running request in one engine step)."""
    steps: int = 0              # engine steps
    request_steps: int = 0
    drafted: int = 0            # usable drafts: min(n, tokens left - 1) per request-step
    accepted: int = 0           # drafts accepted
    emitted: int = 0            # tokens emitted by decode steps (accepted + bonus)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens per request-step incl. the bonus token (the simulator's `accept`)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def snapshot(self) -> dict:
        return dict(dataclasses.asdict(self), mean_accepted_tokens=self.mean_accepted_tokens,
                    acceptance_rate=self.acceptance_rate)


def spec_step(graphdef, state, cache, pend_h, inputs: StepInputs, pend_n, host_drafts, *,
              drafter: Drafter, n: int, impl: str, sampling: str):
    """One speculative step for every slot: the decode step (`steps.open_step`, the
    model's forward, `steps.close_step`) with the drafter before the forward and
    `sampling.verify` after it. inputs.tokens [b, n+1]: each slot's pending tokens
    (`DraftInputs.pend_tok`, the last real one is x_L); pend_n [b]: how many are real;
    host_drafts [b, n]. → (targets int32 [b, n+1], their log-probs [b, n+1], accepted
    drafts [b], verify hidden [b, n+1, d], drafts [b, n], cache); lengths roll back to
    L + accepted + 1, accepted capped by the tokens each request may still emit."""
    model = nnx.merge(graphdef, state)
    cache, saved = open_step(cache, inputs.active)
    before = cache.lengths
    drafts, cache = drafter.propose(model, cache, DraftInputs(pend_h, inputs.tokens, pend_n,
                                                              host_drafts), n=n, impl=impl)
    tokens = jnp.concatenate([last_tokens(inputs, pend_n)[:, None], drafts], axis=1)
    h, cache = model(tokens, cache, impl=impl)
    return finish_spec(model, h, cache, saved, inputs, before, drafts, rule=sampling)


def last_tokens(inputs: StepInputs, pend_n) -> jax.Array:
    """Each slot's last real pending token x_L [b]: the first position a step verifies."""
    return inputs.tokens[jnp.arange(inputs.tokens.shape[0]), pend_n - 1]


def finish_spec(model, h, cache, saved, inputs: StepInputs, before, drafts, *, rule: str):
    """The end of a speculative step, after the verify forward's final-normed hidden
    h [b, n+1, d]: `sampling.verify`, the cap on tokens left, `steps.close_step` with
    lengths rolled back to before + accepted + 1, the penalty tables counted → the
    outputs of `spec_step`. Shared by both fetch paths."""
    active = inputs.active
    tok, logp, accepted = verify(model.logits(h), drafts, inputs.sampling, rule, cache.seen)
    accepted = jnp.minimum(accepted, jnp.maximum(inputs.limit - 1, 0)).astype(jnp.int32)
    cache = close_step(cache, active, saved, lengths=before + accepted + 1)
    cache = dataclasses.replace(cache, seen=penalize.count(
        cache.seen, tok, jnp.where(active, accepted + 1, 0)))
    return tok, logp, accepted, h, drafts, cache


def mtp_fixup(model, cache, prompt: np.ndarray, lo: int, hidden: np.ndarray, *, impl: str):
    """The MTP block of the piece lo .. lo + w - 1 again, from that piece's main hidden
    states [w, d] (kept by the prefix cache) and the followers `prompt` [1, n] has now:
    a cached prefix whose last position ended its own prompt gets that position's MTP
    row exactly as a prefill of this prompt computes it (`model.prefill.prefill` with
    `mtp_next`)."""
    w = hidden.shape[0]
    return mtp_rows(model, cache, jnp.asarray(hidden)[None],
                    mtp_followers(prompt[:, 1:], lo, w), jnp.asarray([lo], jnp.int32),
                    impl=impl, scan_len=prefill_scan(lo + w, cache.max_len))
