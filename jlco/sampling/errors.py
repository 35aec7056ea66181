"""How the engine refuses a request: `RequestError`, naming the field and the reason
kind, shared by the sampling parameters' checks (`params`, `penalties`) and the engine's
scheduler (which re-exports it). Plain Python, below the engine."""

from __future__ import annotations

# Why a request is refused (`RequestError.kind`): a bad value; prompt + max_new_tokens
# beyond engine.max_context_len; no such request; no free batch slot / host pages now
# (the same request may fit later).
REFUSALS = ("invalid", "too_long", "not_found", "no_slot", "no_pages")


class RequestError(ValueError):
    """A refused request. The message names the field and what is allowed; `field` is
    that field (None when no single field is at fault) and `kind` one of REFUSALS, so a
    caller (the server's HTTP status) decides on them, never on the message's text."""

    def __init__(self, message: str, field: str | None = None, kind: str = "invalid"):
        if kind not in REFUSALS:
            raise ValueError(f"kind={kind!r} is invalid: allowed one of {REFUSALS}")
        super().__init__(message)
        self.field, self.kind = field, kind
