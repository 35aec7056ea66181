"""Agentic sessions for `tools/bench_agentic.py`: the JSON-lines trace format, a synthetic
generator, and the conversation a replayed session has built so far.

Trace format: one JSON object per line, one line per turn; a session's lines in turn
order (sessions may interleave in the file):

    {"session": "s0", "turn": 0, "system": "You are a coding agent...",
     "user": "Fix the failing test", "tool_results": [], "output_tokens": 64}
    {"session": "s0", "turn": 1, "user_tokens": 40, "tool_results": [1800, "ok"],
     "output_tokens": 48}

  session        str: the session's name
  turn           int: 0, 1, ... in the session
  system         str (turn 0 only, optional): the system prompt; `system_tokens`: int,
                 synthetic text of that many tokens instead
  user           str: the new user text of this turn; `user_tokens`: int instead (either,
                 or neither when the turn only returns tool results)
  tool_results   list of str (the text) or int (synthetic text of that many tokens): the
                 results of tool calls the previous reply made; none on turn 0
  output_tokens  int >= 1: the reply's length (max_tokens; a reply may end sooner)

Synthetic text is lowercase words drawn from a seeded generator: one token per character
on the byte-level tokenizer of the random-weight model, about a quarter of that on a real
BPE tokenizer. The replayed history holds what the server really answered; a reply
followed by tool results is given one tool call per result (`run`, {"i": j}), as an
agent's reply that called the tools would be, so the next prompt extends the previous
one as in a real agentic session and the prefix cache can serve it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
TOOL = "run"


@dataclasses.dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    user: str | None
    tool_results: tuple[str, ...]
    output_tokens: int
    system: str | None = None


def synthetic_text(n: int, seed) -> str:
    """`n` characters of lowercase words (5-letter average), the same for the same seed."""
    rng = np.random.default_rng(seed)
    chars = LETTERS[rng.integers(0, 26, n)].copy()
    chars[rng.random(n) < 0.18] = ord(" ")
    return chars.tobytes().decode()


def _text(v, field: str, where: str, seed) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return synthetic_text(v, seed)
    raise ValueError(f"{where}: {field}={json.dumps(v)[:40]} is invalid: allowed a string "
                     "or a token count (an integer >= 0)")


def parse_turn(doc: dict, where: str, seed: int = 0) -> Turn:
    """One trace line → Turn (synthetic text made from `seed`, the session and turn), or a
    ValueError naming the line and field."""
    known = {"session", "turn", "system", "system_tokens", "user", "user_tokens",
             "tool_results", "output_tokens"}
    extra = set(doc) - known
    if extra:
        raise ValueError(f"{where}: unknown field {sorted(extra)[0]!r} (allowed: "
                         f"{sorted(known)})")
    sess, turn, out = doc.get("session"), doc.get("turn"), doc.get("output_tokens")
    if not isinstance(sess, str) or not sess:
        raise ValueError(f"{where}: session is required: a non-empty string")
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 0:
        raise ValueError(f"{where}: turn is required: an integer >= 0")
    if not isinstance(out, int) or isinstance(out, bool) or out < 1:
        raise ValueError(f"{where}: output_tokens is required: an integer >= 1")
    key = [seed, int.from_bytes(sess.encode()[:8], "little"), turn]
    system = None
    if "system" in doc or "system_tokens" in doc:
        if turn != 0:
            raise ValueError(f"{where}: system is allowed on turn 0 only")
        system = _text(doc.get("system", doc.get("system_tokens")), "system", where, key + [0])
    user = None
    if "user" in doc or "user_tokens" in doc:
        user = _text(doc.get("user", doc.get("user_tokens")), "user", where, key + [1])
    results = doc.get("tool_results") or []
    if not isinstance(results, list):
        raise ValueError(f"{where}: tool_results: allowed a list of strings or token counts")
    if turn == 0 and results:
        raise ValueError(f"{where}: tool_results on turn 0: no reply has called a tool yet")
    tools = tuple(_text(r, f"tool_results[{i}]", where, key + [2, i])
                  for i, r in enumerate(results))
    if user is None and not tools:
        raise ValueError(f"{where}: a turn needs user text or tool_results")
    return Turn(sess, turn, user, tools, out, system)


def read_trace(path: pathlib.Path, seed: int = 0) -> dict[str, list[Turn]]:
    """A JSON-lines trace → {session: its turns in order}, checked (turns 0, 1, ...)."""
    sessions: dict[str, list[Turn]] = {}
    for i, line in enumerate(pathlib.Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            doc = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: not JSON: {err}") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: a JSON object is expected")
        t = parse_turn(doc, where, seed)
        turns = sessions.setdefault(t.session, [])
        if t.turn != len(turns):
            raise ValueError(f"{where}: session {t.session!r} turn {t.turn} out of order "
                             f"(expected {len(turns)})")
        turns.append(t)
    if not sessions:
        raise ValueError(f"{path}: no turns")
    return sessions


def synthetic(num_sessions: int, turns: tuple[int, int], context: tuple[int, int],
              output_tokens: int, seed: int = 0) -> list[dict]:
    """Trace lines of `num_sessions` sessions, interleaved turn by turn: each has a turn
    count in `turns` (inclusive) and grows to a total context in `context`: a system
    prompt and first request of a quarter of it, then per turn a user message (1 turn
    in 3) and tool results sharing the rest, `output_tokens` per reply."""
    rng = np.random.default_rng(seed)
    per: list[list[dict]] = []
    for s in range(num_sessions):
        n = int(rng.integers(turns[0], turns[1] + 1))
        total = int(rng.integers(context[0], context[1] + 1))
        first = total // 4
        rest = max(total - first - n * output_tokens, n - 1)
        shares = rng.dirichlet(np.ones(max(n - 1, 1))) * rest
        lines = [{"session": f"s{s}", "turn": 0, "system_tokens": first * 3 // 4,
                  "user_tokens": first - first * 3 // 4, "output_tokens": output_tokens}]
        for t in range(1, n):
            add = max(int(shares[t - 1]), 1)
            user = add // 5 if t % 3 == 0 else 0
            k = int(rng.integers(1, 4))
            tools = [max((add - user) // k, 1)] * k
            line = {"session": f"s{s}", "turn": t, "tool_results": tools,
                    "output_tokens": output_tokens}
            if user:
                line["user_tokens"] = user
            lines.append(line)
        per.append(lines)
    return [s[t] for t in range(max(map(len, per))) for s in per if t < len(s)]


def write_trace(lines: list[dict], path: pathlib.Path) -> None:
    pathlib.Path(path).write_text("".join(json.dumps(x) + "\n" for x in lines))


@dataclasses.dataclass
class Step:
    """One turn of a replayed session: what was sent and what the server answered."""
    turn: Turn
    reply: str | None = None        # None: not answered yet


class Conversation:
    """A session's history as each route sends it. The reply of step k gets one tool
    call per tool result of step k+1 (ids `call_<session>_<k>_<j>`)."""

    def __init__(self, session: str):
        self.session = session
        self.steps: list[Step] = []
        self.system: str | None = None

    def add(self, turn: Turn) -> None:
        if turn.system is not None:
            self.system = turn.system
        self.steps.append(Step(turn))

    def call_ids(self, k: int) -> list[str]:
        nxt = self.steps[k + 1].turn.tool_results if k + 1 < len(self.steps) else ()
        return [f"call_{self.session}_{k}_{j}" for j in range(len(nxt))]

    def chat_messages(self) -> list[dict]:
        msgs = [] if self.system is None else [{"role": "system", "content": self.system}]
        for k, st in enumerate(self.steps):
            prev = self.call_ids(k - 1) if k else []
            msgs += [{"role": "tool", "tool_call_id": c, "content": r}
                     for c, r in zip(prev, st.turn.tool_results)]
            if st.turn.user is not None:
                msgs.append({"role": "user", "content": st.turn.user})
            if st.reply is not None:
                m = {"role": "assistant", "content": st.reply}
                calls = self.call_ids(k)
                if calls:
                    m["tool_calls"] = [{"id": c, "type": "function", "function": {
                        "name": TOOL, "arguments": json.dumps({"i": j})}}
                        for j, c in enumerate(calls)]
                msgs.append(m)
        return msgs

    def anthropic_messages(self) -> list[dict]:
        out = []
        for k, st in enumerate(self.steps):
            prev = self.call_ids(k - 1) if k else []
            blocks = [{"type": "tool_result", "tool_use_id": c, "content": r}
                      for c, r in zip(prev, st.turn.tool_results)]
            if st.turn.user is not None:
                blocks.append({"type": "text", "text": st.turn.user})
            out.append({"role": "user", "content": blocks})
            if st.reply is not None:
                content = [{"type": "text", "text": st.reply}] if st.reply else []
                content += [{"type": "tool_use", "id": c, "name": TOOL, "input": {"i": j}}
                            for j, c in enumerate(self.call_ids(k))]
                out.append({"role": "assistant", "content": content or ""})
        return out

    def responses_input(self) -> list[dict]:
        """The newest step's input items, for a request chained by previous_response_id
        to the one that answered the step before (its calls, their outputs, the text)."""
        k = len(self.steps) - 1
        st = self.steps[k]
        prev = self.call_ids(k - 1) if k else []
        items = [{"type": "function_call", "call_id": c, "name": TOOL,
                  "arguments": json.dumps({"i": j})} for j, c in enumerate(prev)]
        items += [{"type": "function_call_output", "call_id": c, "output": r}
                  for c, r in zip(prev, st.turn.tool_results)]
        if st.turn.user is not None:
            items.append({"type": "message", "role": "user", "content": st.turn.user})
        return items
