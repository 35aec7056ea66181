"""Thinking split from content, whole and streamed (delimiters cut anywhere), whether
the output starts inside thinking (read off the prompt), and the reasoning token count."""

import random

import pytest

from jlco.chat.deepseek_v32 import encode_messages
from jlco.chat.reasoning import (ReasoningParser, count_reasoning_tokens,
                                 prompt_opens_thinking, reasoning_parser_for,
                                 thinking_from_kwargs)


def streamed(parser, text, cuts):
    out, last = [], 0
    for cut in list(cuts) + [len(text)]:
        out += parser.feed(text[last:cut])
        last = cut
    out += parser.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in out)
    content = "".join(d.get("content", "") for d in out)
    for d in out:
        assert len(d) == 1 and set(d) <= {"reasoning_content", "content"} and any(d.values())
    return reasoning, content


CASES = [
    (True, "Let me think.\n2+2=4</think>The answer is 4.", ("Let me think.\n2+2=4",
                                                           "The answer is 4.")),
    (True, "<think>again</think>ok", ("again", "ok")),
    (True, "never closes </thin", ("never closes </thin", "")),
    (True, "</think>", ("", "")),
    (True, "a</think>b</think>c <think>d", ("a", "b</think>c <think>d")),
    (False, "Just content, <think> later is text.", ("", "Just content, <think> later "
                                                         "is text.")),
    (False, "<think>x</think>\ny", ("x", "\ny")),
    (False, "<thinking>", ("", "<thinking>")),
    (False, "<thi", ("", "<thi")),
    (False, "", ("", "")),
]


@pytest.mark.parametrize("starts, text, want", CASES)
def test_whole(starts, text, want):
    assert ReasoningParser(starts).parse(text) == want


@pytest.mark.parametrize("starts, text, want", CASES)
def test_streamed_at_every_split_and_random_chunks(starts, text, want):
    for i in range(len(text) + 1):
        assert streamed(ReasoningParser(starts), text, [i]) == want, i
    assert streamed(ReasoningParser(starts), text, range(1, len(text))) == want
    rng = random.Random(7)
    for _ in range(60):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
        assert streamed(ReasoningParser(starts), text, cuts) == want, cuts


def test_reasoning_streams_before_the_delimiter_arrives():
    p = ReasoningParser(True)
    assert p.feed("step one, </th") == [{"reasoning_content": "step one, "}]
    assert p.feed("ink>Answer") == [{"content": "Answer"}]


def test_parse_leaves_streaming_state_alone():
    p = ReasoningParser(True)
    p.feed("half")
    assert p.parse("x</think>y") == ("x", "y")
    assert p.feed("</think>done") == [{"content": "done"}]


def test_deepseek_prompts_say_where_generation_starts():
    msgs = [{"role": "user", "content": "Hi"}]
    assert prompt_opens_thinking(encode_messages(msgs, thinking=True))
    assert not prompt_opens_thinking(encode_messages(msgs, thinking=False))
    p = reasoning_parser_for("deepseek_v32", encode_messages(msgs, thinking=True))
    assert p.parse("hmm</think>Hello") == ("hmm", "Hello")
    p = reasoning_parser_for("deepseek_v32", encode_messages(msgs, thinking=False))
    assert p.parse("Hello") == ("", "Hello")


def test_glm5_generation_prompts():
    # GLM-5's template: `<|assistant|><think>` on, `<|assistant|><think></think>` off
    on = reasoning_parser_for("glm_moe_dsa", "[gMASK]<sop><|user|>Hi<|assistant|><think>")
    off = reasoning_parser_for("glm_moe_dsa",
                               "[gMASK]<sop><|user|>Hi<|assistant|><think></think>")
    assert on.parse("r</think>c") == ("r", "c")
    assert off.parse("c") == ("", "c")


def test_unknown_model_type_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"model_type: 'qwen3' .*deepseek_v32, glm_moe_dsa"):
        reasoning_parser_for("qwen3", "")


START, END = 128798, 128799


@pytest.mark.parametrize("ids, starts, want", [
    ([5, 6, 7, END, 8, 9], True, 3),
    ([5, 6, 7], True, 3),                   # never closed: all of it
    ([END, 8], True, 0),
    ([START, 5, 6, END, 7], True, 2),       # a repeated opener is not counted
    ([START, 5, 6, END, 7], False, 2),      # the output opens it itself
    ([5, START, 6, END], False, 0),         # not at the start: content
    ([], True, 0),
])
def test_count_reasoning_tokens(ids, starts, want):
    assert count_reasoning_tokens(ids, START, END, starts) == want


def test_thinking_from_kwargs():
    assert thinking_from_kwargs(None, default=False) is False
    assert thinking_from_kwargs({}, default=True) is True
    assert thinking_from_kwargs({"thinking": True}, default=False) is True
    assert thinking_from_kwargs({"enable_thinking": False}, default=True) is False
    assert thinking_from_kwargs({"thinking": False, "enable_thinking": True},
                                default=False) is True
    assert thinking_from_kwargs({"thinking": False, "other": 1}, default=True) is False
    with pytest.raises(ValueError, match=r"^chat_template_kwargs.thinking: must be true "
                                         r"or false"):
        thinking_from_kwargs({"thinking": "yes"}, default=False)
