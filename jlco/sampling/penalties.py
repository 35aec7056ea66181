"""A request's penalty and bias fields as the engine takes them (plain Python, checked
with the rest of the request): OpenAI's presence and frequency penalties and
logit_bias, vLLM's repetition_penalty and min_tokens. The device side (the per-slot
tables and how the step applies them) is `jlco.sampling.penalize`.

The ranges are vLLM's (`SamplingParams`): presence and frequency in [-2, 2], repetition
in (0, 2], a bias in [-100, 100]. The tables have fixed widths so no request compiles
anything: at most MAX_LOGIT_BIAS biased tokens, and with min_tokens at most
MAX_HELD_STOPS stop ids held back.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from jlco.sampling.errors import RequestError
from jlco.util.sampling_tables import MAX_HELD_STOPS, MAX_LOGIT_BIAS  # noqa: F401 (re-exported)


@dataclasses.dataclass(frozen=True)
class Penalties:
    """presence: subtracted once from every token generated so far; frequency: times
    how often it was generated; repetition: divides a positive logit (multiplies a
    negative one) of every token in the prompt or generated so far; min_tokens: the stop
    token ids are held back (-inf) until this many tokens were generated; logit_bias:
    (token id, value) pairs added to those logits. The defaults change nothing."""
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def active(self) -> bool:
        """Any field changes a logit (a request without them skips the tables)."""
        return self != Penalties()


def _number(name: str, v, lo: float, hi: float, *, open_lo: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or not ((lo < v) if open_lo else (lo <= v)) or not v <= hi:
        span = f"({lo:g}, {hi:g}]" if open_lo else f"[{lo:g}, {hi:g}]"
        raise RequestError(f"{name}={v!r}: allowed a number in {span}", name)
    return float(v)


def check_penalties(p, *, vocab_size: int, max_new_tokens: int,
                    stop_token_ids: Iterable[int]) -> Penalties:
    """`p` (a Penalties, or None for none) with every field in range and normalised
    (floats, the bias as sorted (int, float) pairs), or RequestError naming the field."""
    if p is None:
        return Penalties()
    if not isinstance(p, Penalties):
        raise RequestError(f"penalties={p!r}: allowed a jlco.sampling.penalties.Penalties",
                           "penalties")
    presence = _number("presence_penalty", p.presence, -2.0, 2.0)
    frequency = _number("frequency_penalty", p.frequency, -2.0, 2.0)
    repetition = _number("repetition_penalty", p.repetition, 0.0, 2.0, open_lo=True)
    m = p.min_tokens
    if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= max_new_tokens:
        raise RequestError(f"min_tokens={m!r}: allowed an integer in 0..max_tokens "
                           f"({max_new_tokens})", "min_tokens")
    held = len(set(stop_token_ids))
    if m and held > MAX_HELD_STOPS:
        raise RequestError(f"min_tokens={m} holds back at most {MAX_HELD_STOPS} stop token "
                           f"ids; this request has {held}", "min_tokens")
    bias = dict(p.logit_bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias: {len(bias)} tokens; allowed at most "
                           f"{MAX_LOGIT_BIAS}", "logit_bias")
    pairs = []
    for t, v in sorted(bias.items()):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"logit_bias: token {t!r} is not a token id in "
                               f"0..{vocab_size - 1}", "logit_bias")
        pairs.append((t, _number("logit_bias", v, -100.0, 100.0)))
    return Penalties(presence, frequency, repetition, m, tuple(pairs))
