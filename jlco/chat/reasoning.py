"""Thinking text split from the answer: what a model writes inside its thinking
delimiters goes to the API's `reasoning_content`, the rest to `content`.

Both formats jlco serves use `<think>` ... `</think>`, and both open the thinking block
in the prompt when thinking is on: DeepSeek-V3.2's encoder ends the prompt with
`<｜Assistant｜><think>` (thinking) or `<｜Assistant｜></think>` (chat), GLM-5's template
with `<|assistant|><think>` or `<|assistant|><think></think>`. So whether the output
starts inside thinking is read off the prompt (`prompt_opens_thinking`), not guessed
from the output; a `<think>` the model writes itself at the very start of its output is
also understood (templates that leave opening it to the model).

The token count for usage.completion_tokens_details.reasoning_tokens follows the same
rule on token ids (`count_reasoning_tokens`)."""

from __future__ import annotations

from typing import Sequence

from jlco.chat._text import Scanner

THINK_START, THINK_END = "<think>", "</think>"

# format -> (start, end) delimiters
DELIMITERS = {"deepseek_v32": (THINK_START, THINK_END), "glm5": (THINK_START, THINK_END)}
MODEL_TYPES = {"deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm5"}


def prompt_opens_thinking(prompt: str, start: str = THINK_START) -> bool:
    """Whether the generation continues inside a thinking block the prompt opened."""
    return prompt.rstrip().endswith(start)


def thinking_from_kwargs(kwargs: dict | None, default: bool) -> bool:
    """The thinking switch of a request's chat_template_kwargs: `thinking` (DeepSeek's
    name) or `enable_thinking` (GLM's, also what vLLM reads for both); booleans only. Either one true turns thinking
    on (vLLM's rule); neither given: `default`."""
    given = []
    for key in ("thinking", "enable_thinking"):
        if kwargs and key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise ValueError(f"chat_template_kwargs.{key}: must be true or false, "
                                 f"not {kwargs[key]!r}")
            given.append(kwargs[key])
    return any(given) if given else default


class ReasoningParser:
    """Splits one response, whole (`parse`) or streamed (`feed` deltas, then `finish`
    once). Deltas are {"reasoning_content": ...} and {"content": ...}; joined they give
    exactly `parse`'s result, however the text was cut. A response that ends before
    the closing delimiter (max_tokens) is all reasoning."""

    def __init__(self, starts_in_reasoning: bool, start: str = THINK_START,
                 end: str = THINK_END) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.start, self.end = start, end
        self._scan = Scanner()
        self._state = "open"        # at the start: a leading `start` may still come
        self._out: list[dict] = []

    def feed(self, delta: str) -> list[dict]:
        self._scan.add(delta)
        self._run(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._run(final=True)
        rest = self._scan.take_all()
        self._emit("content" if self._state == "content" else "reasoning_content", rest)
        return self._take()

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning_content, content) of a whole response."""
        fresh = ReasoningParser(self.starts_in_reasoning, self.start, self.end)
        reasoning, content = [], []
        for d in fresh.feed(text) + fresh.finish():
            reasoning.append(d.get("reasoning_content", ""))
            content.append(d.get("content", ""))
        return "".join(reasoning), "".join(content)

    def _run(self, final: bool) -> None:
        if self._state == "open":
            buf = self._scan.buf
            if buf.startswith(self.start):
                self._scan.buf = buf[len(self.start):]
                self._state = "reasoning"
            elif self.start.startswith(buf) and not final:
                return      # still maybe the opening delimiter
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        if self._state == "reasoning":
            text, hit = self._scan.until(self.end)
            self._emit("reasoning_content", text)
            if hit is None:
                return
            self._state = "content"
        self._emit("content", self._scan.take_all())

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if self._out and kind in self._out[-1]:
            self._out[-1][kind] += text
        else:
            self._out.append({kind: text})

    def _take(self) -> list[dict]:
        out, self._out = self._out, []
        return out


def count_reasoning_tokens(token_ids: Sequence[int], start_id: int, end_id: int,
                           starts_in_reasoning: bool) -> int:
    """Generated tokens inside the thinking block, delimiters not counted: from the
    first token (when the prompt opened the block, or the output opens it first thing)
    up to the closing delimiter, or to the end when it never closes."""
    ids = list(token_ids)
    inside = starts_in_reasoning
    if ids and ids[0] == start_id:
        inside, ids = True, ids[1:]
    if not inside:
        return 0
    return ids.index(end_id) if end_id in ids else len(ids)


def reasoning_parser_for(model_type: str, prompt: str) -> ReasoningParser:
    """A fresh splitter for one response of a `model_type` checkpoint (config.json)
    continuing `prompt` (the rendered text the engine was given)."""
    fmt = MODEL_TYPES.get(model_type)
    if fmt is None:
        raise ValueError(f"model_type: {model_type!r} has no reasoning parser (allowed: "
                         f"{', '.join(sorted(MODEL_TYPES))})")
    start, end = DELIMITERS[fmt]
    return ReasoningParser(prompt_opens_thinking(prompt, start), start, end)
