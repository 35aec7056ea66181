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
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jlco.engine import host_driven as engine_host
from jlco.engine import penalize
from jlco.engine.inputs import DecodeOutput, StepInputs, alternatives
from jlco.engine.sampling import verify
from jlco.engine.steps import close_step, open_step
from jlco.model.prefill import final_logits, prefill
from jlco.model.kv_cache import prefill_scan


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
    active = inputs.active
    cache, saved = open_step(cache, active)
    before = cache.lengths
    drafts, cache = drafter.propose(model, cache, DraftInputs(pend_h, inputs.tokens, pend_n,
                                                              host_drafts), n=n, impl=impl)
    last = inputs.tokens[jnp.arange(inputs.tokens.shape[0]), pend_n - 1]
    h, cache = model(jnp.concatenate([last[:, None], drafts], axis=1), cache, impl=impl)
    tok, logp, accepted = verify(model.logits(h), drafts, inputs.sampling, sampling, cache.seen)
    accepted = jnp.minimum(accepted, jnp.maximum(inputs.limit - 1, 0)).astype(jnp.int32)
    cache = close_step(cache, active, saved, lengths=before + accepted + 1)
    cache = dataclasses.replace(cache, seen=penalize.count(
        cache.seen, tok, jnp.where(active, accepted + 1, 0)))
    return tok, logp, accepted, h, drafts, cache


@functools.lru_cache(maxsize=None)
def _jitted_step(drafter: Drafter, n: int, impl: str, sampling: str, out_shardings):
    """`spec_step` jitted once per (drafter class, n, impl, spec_sampling, output
    shardings), so engines built alike share one compiled step. out_shardings: (leaves,
    treedef) or None (offload off: jit keeps everything on device)."""
    fn = functools.partial(spec_step, drafter=drafter, n=n, impl=impl, sampling=sampling)
    if out_shardings is None:
        return jax.jit(fn, donate_argnums=2)
    return jax.jit(fn, donate_argnums=2,
                   out_shardings=jax.tree.unflatten(out_shardings[1], out_shardings[0]))


@functools.partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def _main_chunk(graphdef, state, cache, tokens, n_new, *, impl):
    """A prefill chunk through the main model → (final-normed hidden [b, c, d], cache)."""
    return nnx.merge(graphdef, state)(tokens, cache, n_new, impl=impl)


@functools.partial(jax.jit, static_argnames=("impl",), donate_argnames=("cache",))
def _mtp_chunk(graphdef, state, cache, h, next_tokens, start, *, impl):
    """The MTP block over a prefill chunk's positions: writes its cache rows only (the
    draft logits are dead code here and compiled away)."""
    return nnx.merge(graphdef, state).mtp_logits(h, next_tokens, cache, start, impl=impl)[2]


def prefill_with_mtp(model, cache, prompt: np.ndarray, lo: int, hi: int, *, chunk: int,
                     impl: str, scan_len: int | None | str = "auto"):
    """Prefill prompt [1, n] positions lo..hi-1 (cache.lengths == lo) in chunks of
    `chunk` (the shapes `jlco.model.prefill` uses), and after each chunk the MTP block over
    the same positions with the following prompt token. The last prompt position's
    follower is the first generated token: its MTP row is written by the first
    speculative step. → (logits [1, V] at position hi-1, its hidden [1, d], cache, the
    last chunk's hidden [1, chunk, d])."""
    graphdef, state = model
    n = prompt.shape[1]
    last_h = h = None
    for start in range(lo, hi, chunk):
        width = min(chunk, hi - start)
        piece = np.zeros((1, chunk), np.int32)
        piece[:, :width] = prompt[:, start:start + width]
        # Both blocks scan the keys as `jlco.model.prefill` does (`scan_len` likewise).
        scan = prefill_scan(start + chunk, cache.max_len) if scan_len == "auto" else scan_len
        cache = dataclasses.replace(cache, scan_len=scan)
        h, cache = _main_chunk(graphdef, state, cache, jnp.asarray(piece),
                               jnp.asarray([width], jnp.int32), impl=impl)
        cache = _mtp_chunk(graphdef, state, cache, h, _followers(prompt, start, chunk, n),
                           jnp.asarray([start], jnp.int32), impl=impl)
        cache = dataclasses.replace(cache, scan_len=None)
        last_h = h[:, width - 1]
    return final_logits(graphdef, state, last_h), last_h, cache, h


def _followers(prompt: np.ndarray, start: int, chunk: int, n: int) -> jax.Array:
    """The MTP block's next tokens [1, chunk] for positions start .. (0 past the prompt)."""
    follow = np.zeros((1, chunk), np.int32)
    nxt = prompt[:, start + 1:min(start + chunk + 1, n)]
    follow[:, :nxt.shape[1]] = nxt
    return jnp.asarray(follow)


def mtp_fixup(model, cache, prompt: np.ndarray, lo: int, hidden: np.ndarray, *, impl: str):
    """The MTP block of the piece lo .. lo + w - 1 again, from that piece's main hidden
    states [w, d] (kept by the prefix cache) and the followers `prompt` [1, n] has now:
    a cached prefix whose last position ended its own prompt gets that position's MTP
    row exactly as a prefill of this prompt computes it (`prefill_with_mtp`)."""
    graphdef, state = model
    w = hidden.shape[0]
    cache = dataclasses.replace(cache, scan_len=prefill_scan(lo + w, cache.max_len))
    cache = _mtp_chunk(graphdef, state, cache, jnp.asarray(hidden)[None],
                       _followers(prompt, lo, w, prompt.shape[1]),
                       jnp.asarray([lo], jnp.int32), impl=impl)
    return dataclasses.replace(cache, scan_len=None)


class Speculator:
    """The runner's speculative stepping (`cfg.engine.num_draft_tokens` > 0). Keeps, per
    batch slot, the main hidden states of the positions the MTP layer has not seen yet
    (on device) and, per request, how many there are."""

    def __init__(self, runner, drafter: Drafter | None = None):
        cfg = runner.cfg
        self.n = cfg.engine.num_draft_tokens
        if self.n < 1:
            raise ValueError(f"engine.num_draft_tokens={self.n}: speculative decoding needs "
                             "an integer in 1..7")
        self.drafter = MTPDrafter() if drafter is None else drafter
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"drafter={drafter!r}: allowed a jlco.engine.speculative.Drafter")
        if self.drafter.needs_mtp_cache and nnx.merge(runner.graphdef, runner.state).mtp is None:
            raise ValueError(f"engine.num_draft_tokens={self.n} with MTP drafts needs a model "
                             "with an MTP layer (model.num_nextn_predict_layers=1)")
        if runner.trace is not None:
            raise ValueError("trace_path: top-k traces record s_q = 1 steps; set "
                             "engine.num_draft_tokens=0 to record one")
        if runner.offload and engine_host.resolve_fetch_path(cfg) == "host_driven":
            raise NotImplementedError(
                f"engine.num_draft_tokens={self.n} with cache.fetch_path='host_driven' "
                "(or storage 'file'): speculative steps run the in-jit fetch path only")
        # What the step needs of the runner, read once: the speculator returns new
        # state to the runner and never writes the runner's.
        self.graphdef, self.state, self.impl = runner.graphdef, runner.state, runner.impl
        self.batch, self.offload, self.vocab = runner.batch, runner.offload, cfg.model.vocab_size
        self.metrics = SpecMetrics()
        # Committed to the device like the step's outputs: an uncommitted first input
        # would make the second step compile again.
        self.pend_h = jax.device_put(
            jnp.zeros((runner.batch, self.n + 1, cfg.model.hidden_size),
                      jnp.dtype(cfg.model.dtype)), jax.devices()[0])
        self.pend_n: dict[int, int] = {}
        self._fresh: dict[int, jax.Array] = {}
        # Set to a list to record (request id, slot, tokens before the step, drafts).
        self.draft_log: list | None = None
        shard = None
        if runner.offload:   # the host pool must come back in host memory (steps.py)
            dev = SingleDeviceSharding(jax.devices()[0])
            leaves, tree = jax.tree.flatten((dev,) * 5 + (runner.cache_shardings(),))
            shard = (tuple(leaves), tree)
        self._jit = _jitted_step(self.drafter, self.n, runner.impl, cfg.engine.spec_sampling,
                                 shard)

    def prefill(self, req, temp, prompt, lo, hi, chunk, scan_len="auto"):
        """The runner's prefill of prompt positions lo..hi-1, with the MTP rows filled
        when the drafter reads them; remembers the last hidden for the first step
        (`req` None: a warm-up compile, nothing remembered) → (logits, last hidden,
        cache, the piece's hidden states [1, chunk, d])."""
        model = (self.graphdef, self.state)
        if self.drafter.needs_mtp_cache:
            out = prefill_with_mtp(model, temp, prompt, lo, hi, chunk=chunk, impl=self.impl,
                                   scan_len=scan_len)
        else:
            out = prefill(model, temp, prompt[:, lo:hi], chunk=chunk, impl=self.impl,
                          scan_len=scan_len, keep_hidden=True)
        if req is not None:
            self.admit(req.id, out[1])
        return out

    def admit(self, request_id: int, hidden: jax.Array) -> None:
        """A request's final prompt hidden state [1, d] (prefilled here or imported):
        its first step's MTP catch-up starts from it."""
        self._fresh[request_id] = hidden

    def _inputs(self, running):
        """→ (StepInputs with each slot's pending tokens, pend_n [b], host drafts [b, n])."""
        b, n = self.batch, self.n
        for r in running:
            if r.id in self._fresh:
                self.pend_h = self.pend_h.at[r.slot, 0].set(self._fresh.pop(r.id)[0])
                self.pend_n[r.id] = 1
        # A fixed [b, n+1] token shape: one compiled step.
        inputs = StepInputs.from_requests(running, b, self.vocab,
                                          [self.pend_n[r.id] for r in running], width=n + 1)
        pend_n = np.ones((b,), np.int32)
        slots = [None] * b
        for r in running:
            pend_n[r.slot], slots[r.slot] = self.pend_n[r.id], r
        drafts = np.asarray(self.drafter.host_drafts(slots, n), np.int32)
        vocab = self.vocab
        if drafts.shape != (b, n) or (drafts < -1).any() or (drafts >= vocab).any():
            raise ValueError(f"drafter.host_drafts: must be int32 [{b}, {n}] in -1..{vocab - 1} "
                             f"(-1 = none); got shape {drafts.shape}, range "
                             f"{drafts.min()}..{drafts.max()}")
        return inputs, pend_n, drafts

    def step(self, cache, running, scan_len):
        """Draft + verify in one jit over the runner's `cache` (donated) → (DecodeOutput,
        the new cache, offload counters or None). Per request in `running` order: 1 +
        accepted tokens, their log-probs, the usable drafts (min(n, tokens left - 1)) and
        how many of them were accepted. scan_len: the indexers' scan bucket, above every
        request's last verified position (L + n), as the plain decode step scans."""
        inputs, pend_n, host = self._inputs(running)
        t0 = time.perf_counter()
        tok, logp, acc, self.pend_h, drafts, cache = self._jit(
            self.graphdef, self.state, dataclasses.replace(cache, scan_len=scan_len),
            self.pend_h, inputs, pend_n, host)
        stats = cache.latent.stats if self.offload else None
        tok, logp, acc, drafts, stats = jax.device_get((tok, logp, acc, drafts, stats))
        seconds = time.perf_counter() - t0
        self.metrics.steps += 1
        out_tok, out_logp, out_drafted, out_acc, out_top = [], [], [], [], []
        lp, ids, lps = logp
        for r in running:
            a, left = int(acc[r.slot]), r.max_new_tokens - len(r.tokens)
            usable = min(self.n, left - 1)
            self._count(a, usable)
            out_drafted.append(usable)
            out_acc.append(a)
            if self.draft_log is not None:
                self.draft_log.append((r.id, r.slot, len(r.tokens),
                                       [int(t) for t in drafts[r.slot]]))
            self.pend_n[r.id] = a + 1
            out_tok.append(tuple(int(t) for t in tok[r.slot, :a + 1]))
            out_logp.append(tuple(float(p) for p in lp[r.slot, :a + 1]))
            out_top.append(tuple(alternatives(ids[r.slot, j], lps[r.slot, j], r.top_logprobs)
                                 for j in range(a + 1)))
        out = DecodeOutput(tuple(out_tok), tuple(out_logp), seconds, drafted=tuple(out_drafted),
                           accepted=tuple(out_acc), wait_seconds=seconds, top=tuple(out_top))
        return out, cache, stats

    def _count(self, accepted: int, usable: int) -> None:
        m = self.metrics
        m.request_steps += 1
        m.drafted += usable
        m.accepted += accepted
        m.emitted += accepted + 1

    def forget(self, request_id: int) -> None:
        """Drop one request's state (it finished or was aborted)."""
        for d in (self.pend_n, self._fresh):
            d.pop(request_id, None)
