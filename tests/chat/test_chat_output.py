"""A whole response as one assistant message (reasoning, content, tool calls), and the
same message from its streamed deltas at any chunking."""

import itertools
import json
import random

import pytest

from jlco.chat.deepseek_v32 import encode_messages
from jlco.chat.output import ChatOutput, fold

D = "｜DSML｜"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "days": {"type": "integer"}}}}}]
DS_PROMPT = encode_messages([{"role": "user", "content": "Weather?"}], tools=TOOLS,
                            thinking=True)
GLM_PROMPT = "[gMASK]<sop><|user|>Weather?<|assistant|><think>"

DS_TEXT = ("The user wants weather. Maybe <tool_call>? no.</think>Checking.\n\n"
           f"<{D}function_calls>\n<{D}invoke name=\"get_weather\">\n"
           f'<{D}parameter name="city" string="true">Lyon</{D}parameter>\n'
           f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
           f"</{D}invoke>\n</{D}function_calls>")
GLM_TEXT = ("A <tool_call> written while thinking is thinking.</think>\nOn it."
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def message(model_type, prompt, text, tools=TOOLS):
    return ChatOutput(model_type, prompt, tools, ids()).message(text)


CASES = [("deepseek_v32", DS_PROMPT, DS_TEXT,
          "The user wants weather. Maybe <tool_call>? no.", "Checking."),
         ("glm_moe_dsa", GLM_PROMPT, GLM_TEXT,
          "A <tool_call> written while thinking is thinking.", "\nOn it.")]


@pytest.mark.parametrize("model_type, prompt, text, reasoning, content", CASES)
def test_whole_message(model_type, prompt, text, reasoning, content):
    msg = message(model_type, prompt, text)
    assert msg["reasoning_content"] == reasoning and msg["content"] == content
    (call,) = msg["tool_calls"]
    assert call["id"] == "call_0" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Lyon", "days": 2}


@pytest.mark.parametrize("model_type, prompt, text, reasoning, content", CASES)
def test_streamed_message_matches_at_any_chunking(model_type, prompt, text, reasoning,
                                                  content):
    want = message(model_type, prompt, text)
    rng = random.Random(5)
    cutsets = [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]
    cutsets += [sorted(rng.sample(range(1, len(text)), 12)) for _ in range(50)]
    for cuts in cutsets:
        out = ChatOutput(model_type, prompt, TOOLS, ids())
        deltas, last = [], 0
        for cut in cuts + [len(text)]:
            deltas += out.feed(text[last:cut])
            last = cut
        deltas += out.finish()
        assert fold(deltas) == want, cuts
        assert out.tool_calls_seen


def test_without_tools_calls_stay_text_and_empty_fields_are_null():
    msg = message("glm_moe_dsa", GLM_PROMPT, GLM_TEXT, tools=None)
    assert "tool_calls" not in msg and msg["content"].endswith("</tool_call>")
    only_calls = message("glm_moe_dsa", "<|assistant|><think></think>",
                         "<tool_call>get_weather</tool_call>")
    assert only_calls["content"] is None and only_calls["reasoning_content"] is None
    plain = message("deepseek_v32", "x</think>", "")
    assert plain == {"role": "assistant", "content": "", "reasoning_content": None}
