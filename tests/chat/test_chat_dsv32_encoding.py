"""DeepSeek-V3.2's encoder against prompts written out by hand from the documented
format (encoding/encoding_dsv32.py and its example conversation in the
deepseek-ai/DeepSeek-V3.2 model repository): plain, multi-turn, tools, tool results,
thinking on and off, and the errors a bad conversation gets."""

import copy
import json

import pytest

from jlco.chat.deepseek_v32 import encode_messages, render_tools
from jlco.chat.reasoning import ReasoningParser, prompt_opens_thinking
from jlco.chat.tool_parsers import DeepSeekV32ToolParser

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}

# The tools section as the official example prompt shows it (written out, not built).
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    f'You can invoke functions by writing a "<{D}function_calls>" block like the '
    "following as part of your reply to the user:\n"
    f"<{D}function_calls>\n"
    f'<{D}invoke name="$FUNCTION_NAME">\n'
    f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{D}parameter>\n...\n</{D}invoke>\n"
    f'<{D}invoke name="$FUNCTION_NAME2">\n...\n</{D}invoke>\n'
    f"</{D}function_calls>\n\n"
    "String and scalar parameters should be specified as is without any escaping or "
    "quotes, while lists and objects should use JSON format. The \"string\" attribute "
    "should be set to \"true\" for string type parameters and \"false\" for other types "
    "(numbers, booleans, arrays, objects).\n\n"
    "If the thinking_mode is enabled, then after function results you should strongly "
    "consider outputting a thinking block. Here is an example:\n\n"
    f"<{D}function_calls>\n...\n</{D}function_calls>\n\n"
    "<function_results>\n...\n</function_results>\n\n"
    "<think>...thinking about results</think>\n\n"
    "Here are the functions available in JSONSchema format:\n<functions>\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": '
    '{"type": "integer"}}, "required": ["city"]}}\n'
    "</functions>\n")


def call(name, args, id_="call_1"):
    return {"id": id_, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


PARIS_CALLS = (f"\n\n<{D}function_calls>\n"
               f'<{D}invoke name="get_weather">\n'
               f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
               f"</{D}invoke>\n"
               f'<{D}invoke name="get_weather">\n'
               f'<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
               f'<{D}parameter name="days" string="false">2</{D}parameter>\n'
               f"</{D}invoke>\n"
               f"</{D}function_calls>")

TOOL_LOOP = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Paris and Rome?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need both.",
     "tool_calls": [call("get_weather", {"city": "Paris"}, "a"),
                    call("get_weather", {"city": "Rome", "days": 2}, "b")]},
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
]


def test_plain_chat_mode_ends_with_closed_thinking():
    msgs = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi"}]
    assert encode_messages(msgs) == BOS + "You are helpful." + U + "Hi" + A + "</think>"


def test_plain_thinking_mode_opens_thinking():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, thinking=True) == BOS + U + "Hi" + A + "<think>"


def test_multi_turn_hides_earlier_reasoning():
    msgs = [{"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2", "reasoning_content": "easy"},
            {"role": "user", "content": "times 3?"}]
    head = BOS + U + "1+1?" + A + "</think>2" + EOS + U + "times 3?" + A
    assert encode_messages(msgs, thinking=True) == head + "<think>"
    assert encode_messages(msgs, thinking=False) == head + "</think>"


def test_tool_loop_in_progress_thinking_on():
    want = (BOS + "S\n\n" + TOOLS_SECTION + U + "Paris and Rome?" + A + "<think>"
            + "Need both.</think>" + PARIS_CALLS + EOS
            + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>"
              "\n</function_results>\n\n<think>")
    assert encode_messages(TOOL_LOOP, tools=[WEATHER], thinking=True) == want


def test_tool_loop_in_progress_thinking_off():
    want = (BOS + "S\n\n" + TOOLS_SECTION + U + "Paris and Rome?" + A + "</think>"
            + PARIS_CALLS + EOS
            + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>"
              "\n</function_results>\n\n</think>")
    assert encode_messages(TOOL_LOOP, tools=[WEATHER], thinking=False) == want


def test_finished_tool_loop_before_the_last_user_shows_no_reasoning():
    msgs = TOOL_LOOP + [
        {"role": "assistant", "content": "Sunny, then rain.", "reasoning_content": "ok"},
        {"role": "user", "content": "Thanks"}]
    want = (BOS + "S\n\n" + TOOLS_SECTION + U + "Paris and Rome?" + A + "</think>"
            + PARIS_CALLS + EOS
            + "\n\n<function_results>\n<result>sunny</result>\n<result>rain</result>"
              "\n</function_results>\n\n</think>"
            + "Sunny, then rain." + EOS + U + "Thanks" + A + "<think>")
    assert encode_messages(msgs, tools=[WEATHER], thinking=True) == want


def test_tools_without_a_system_message_get_an_empty_one():
    msgs = [{"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, tools=[WEATHER]) == \
        BOS + "\n\n" + TOOLS_SECTION + U + "Hi" + A + "</think>"


def test_developer_message_carries_tools_inside_the_user_turn():
    msgs = [{"role": "developer", "content": "Find it.", "tools": [WEATHER]}]
    assert encode_messages(msgs, thinking=True) == (
        BOS + U + "\n\n" + TOOLS_SECTION + "\n\n# The user's message is: Find it." + A
        + "<think>")


def test_response_format_joins_the_system_message():
    rf = {"type": "json_object"}
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert encode_messages(msgs, response_format=rf) == (
        BOS + "S\n\n## Response Format:\n\nYou MUST strictly adhere to the following "
        'schema to reply:\n{"type": "json_object"}' + U + "Hi" + A + "</think>")


def test_argument_kinds_and_a_call_without_arguments():
    args = {"q": "café \"x\"", "n": 1.5, "ok": True, "obj": {"a": [1, None]}}
    msgs = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": "Sure.",
             "tool_calls": [call("f", args), {"type": "function", "function": {
                 "name": "now", "arguments": {}}}]}]
    assert encode_messages(msgs, add_bos=False) == (
        U + "go" + A + "</think>Sure.\n\n" + f"<{D}function_calls>\n"
        + f'<{D}invoke name="f">\n'
        + f'<{D}parameter name="q" string="true">café "x"</{D}parameter>\n'
        + f'<{D}parameter name="n" string="false">1.5</{D}parameter>\n'
        + f'<{D}parameter name="ok" string="false">true</{D}parameter>\n'
        + f'<{D}parameter name="obj" string="false">{{"a": [1, null]}}</{D}parameter>\n'
        + f"</{D}invoke>\n" + f'<{D}invoke name="now">\n\n</{D}invoke>\n'
        + f"</{D}function_calls>" + EOS)


def test_text_parts_are_joined_and_inputs_not_changed():
    msgs = [{"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]
    before = copy.deepcopy(msgs)
    assert encode_messages(msgs, tools=[WEATHER]).endswith(U + "ab" + A + "</think>")
    assert msgs == before


@pytest.mark.parametrize("msgs, field", [
    ([], "messages"),
    ([{"role": "bot", "content": "x"}], "messages[0].role"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "messages[1]"),
    (TOOL_LOOP + [{"role": "tool", "content": "extra"}], "messages[5]"),
    (TOOL_LOOP[:4], "messages[2].tool_calls"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "developer", "content": ""}], "messages[0].content"),
])
def test_bad_conversations_name_the_field(msgs, field):
    with pytest.raises(ValueError) as err:
        encode_messages(msgs)
    assert str(err.value).startswith(field + ":")


def test_bad_tools_name_the_field():
    with pytest.raises(ValueError, match=r"^tools\[0\]:"):
        render_tools([{"type": "function", "function": {"description": "no name"}}])
    with pytest.raises(ValueError, match="allowed:|one of"):
        encode_messages([{"role": "robot", "content": ""}])


def test_the_model_s_answer_in_this_format_parses_back_to_the_message():
    """What the prompt teaches the model to write, the parsers read back: the tail of
    an encoded assistant turn (after the generation prompt) is a completion."""
    prompt = encode_messages(TOOL_LOOP[:2], tools=[WEATHER], thinking=True)
    full = encode_messages(TOOL_LOOP[:3], tools=[WEATHER], thinking=True)
    completion = full[len(prompt):-len(EOS)]
    reasoning, content = ReasoningParser(prompt_opens_thinking(prompt)).parse(completion)
    assert reasoning == "Need both."
    text, calls = DeepSeekV32ToolParser([WEATHER]).parse(content)
    assert text == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]
