"""The buffer the streaming parsers scan: text arrives in arbitrary pieces (a token may
end half-way through a delimiter such as `</think>`), so a parser must never act on a
suffix that could still grow into a delimiter. `Scanner.until` is the one place that
rule lives; the reasoning splitter and both tool-call parsers build on it, which is what
makes their output independent of how the text was chunked."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (the
    part to hold back: the next piece may complete the marker)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Scanner:
    """Text received but not yet acted on."""

    def __init__(self) -> None:
        self.buf = ""

    def add(self, text: str) -> None:
        self.buf += text

    def push_front(self, text: str) -> None:
        """Give back text a state consumed but the next state must see."""
        self.buf = text + self.buf

    def until(self, *markers: str, wait: bool = False) -> tuple[str, str | None]:
        """(text before the earliest marker, that marker), consuming both; when no
        marker is there yet: (the text that cannot start one, None), consuming it and
        holding back a possible partial marker -- or, with `wait`, ("", None) consuming
        nothing (for short headers that are only useful whole)."""
        best, hit = -1, None
        for m in markers:
            i = self.buf.find(m)
            if i >= 0 and (best < 0 or i < best or (i == best and len(m) > len(hit))):
                best, hit = i, m
        if hit is not None:
            before, self.buf = self.buf[:best], self.buf[best + len(hit):]
            return before, hit
        if wait:
            return "", None
        keep = max(partial_suffix(self.buf, m) for m in markers)
        cut = len(self.buf) - keep
        before, self.buf = self.buf[:cut], self.buf[cut:]
        return before, None

    def take_all(self) -> str:
        out, self.buf = self.buf, ""
        return out
