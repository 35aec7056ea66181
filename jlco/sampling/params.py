"""A request's sampling parameters as one frozen value: temperature, the filters (top-p,
top-k, min-p), the seed, the stop token ids, the log-prob alternatives it wants, its
penalties and biases, and its token constraint.

Each field is checked once, when the value is made, and a bad one raises RequestError
naming the field and what is allowed. What needs the engine (token ids against its
vocabulary, min_tokens against max_new_tokens, top-k capped at the vocabulary) is
`check`, which the engine's one request check calls. Plain Python (no jax): the
scheduler imports it.
"""

from __future__ import annotations

import copy
import dataclasses

from jlco.sampling.errors import RequestError
from jlco.sampling.penalties import Penalties, check_penalties

MAX_LOGPROBS = 20   # alternatives per position at most (OpenAI's and vLLM's cap)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v, lo: float, hi: float, *, open_lo: bool = False) -> bool:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return ok and (lo < v if open_lo else lo <= v) and v <= hi


def as_int(t):
    """numpy and other integer scalars as Python ints (bools and the rest unchanged)."""
    return int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t


def is_token(t, vocab: int) -> bool:
    return _is_int(t) and 0 <= t < vocab


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples; the defaults are greedy, unfiltered and unpenalised.
    The constraint object itself keeps its request's grammar state, so each request
    needs its own."""
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0                # nucleus sampling (1 = off)
    top_k: int = 0                    # top-k sampling (0 = off)
    min_p: float = 0.0                # min-p sampling (0 = off)
    seed: int = 0                     # token i draws with fold_in(PRNGKey(seed), i)
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0             # alternatives of each generated token
    prompt_logprobs: int | None = None   # alternatives per prompt position (None: no echo)
    penalties: Penalties = Penalties()   # presence/frequency/repetition, bias, min_tokens
    constraint: object = None         # a jlco.sampling.constraint.TokenConstraint (None: free)

    def __post_init__(self):
        """Each field in its range, as Python floats and ints, or RequestError naming it."""
        t, p, k, m, seed = self.temperature, self.top_p, self.top_k, self.min_p, self.seed
        if not _is_number(t, 0.0, 100.0):
            raise RequestError(f"temperature={t!r}: allowed 0 (greedy) .. 100", "temperature")
        if not _is_int(seed) or not 0 <= seed < 2 ** 32:
            raise RequestError(f"seed={seed!r}: allowed an integer in 0..2**32-1", "seed")
        if not _is_number(p, 0.0, 1.0, open_lo=True):
            raise RequestError(f"top_p={p!r}: allowed a number in (0, 1] (1 = off)", "top_p")
        if not _is_int(k) or k < 0:
            raise RequestError(f"top_k={k!r}: allowed an integer >= 0 (0 = off)", "top_k")
        try:
            stops = tuple(as_int(s) for s in self.stop_token_ids)
        except TypeError:
            raise RequestError(f"stop_token_ids={self.stop_token_ids!r}: allowed a list of "
                               "token ids", "stop_token_ids") from None
        for name in ("prompt_logprobs", "top_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise RequestError(f"{name}={v!r}: allowed an integer in 0..{MAX_LOGPROBS}",
                                   name)
        if not _is_number(m, 0.0, 1.0):
            raise RequestError(f"min_p={m!r}: allowed a number in [0, 1] (0 = off)", "min_p")
        c = self.constraint
        if c is not None and not all(hasattr(c, a) for a in ("fill", "consume", "stopped")):
            raise RequestError(f"constraint={c!r}: allowed a "
                               "jlco.sampling.constraint.TokenConstraint or None", "constraint")
        fields = dict(temperature=float(t), top_p=float(p), min_p=float(m), stop_token_ids=stops,
                      top_logprobs=self.top_logprobs or 0,
                      penalties=Penalties() if self.penalties is None else self.penalties)
        for name, v in fields.items():
            object.__setattr__(self, name, v)

    def check(self, vocab_size: int, max_new_tokens: int) -> "SamplingParams":
        """These parameters for a request of up to `max_new_tokens` on a vocabulary of
        `vocab_size`: stop ids and biased ids in it, min_tokens within max_new_tokens →
        the parameters with top_k capped at the vocabulary and the penalties normalised,
        or RequestError naming the field."""
        stops = self.stop_token_ids
        if not all(is_token(t, vocab_size) for t in stops):
            raise RequestError(f"stop_token_ids={list(stops)!r}: allowed token ids in "
                               f"0..{vocab_size - 1}", "stop_token_ids")
        pen = check_penalties(self.penalties, vocab_size=vocab_size,
                              max_new_tokens=max_new_tokens, stop_token_ids=stops)
        out = copy.copy(self)   # the fields are already checked: no second __post_init__
        object.__setattr__(out, "top_k", min(self.top_k, vocab_size))
        object.__setattr__(out, "penalties", pen)
        return out


def sampling_params(params: SamplingParams | None = None, **fields) -> SamplingParams:
    """`params`, or one made of the fields given by keyword (the engine's keyword form:
    `submit(prompt, n, temperature=0.7, seed=3)`); not both."""
    if params is None:
        return SamplingParams(**fields)
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params={params!r}: allowed a SamplingParams (or the sampling "
                        "fields by keyword)")
    if fields:
        raise TypeError(f"give params or the sampling fields {sorted(fields)}, not both")
    return params
