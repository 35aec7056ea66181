"""A chat choice's text → its assistant message (`jlco.server.assistant`), without a
server: forced calls streamed fold to the whole message, thinking goes to
reasoning_content and is counted for usage, and a deepseek_v32 checkpoint without a
chat template is rendered with DeepSeek-V3.2's own encoding."""

from __future__ import annotations

import dataclasses
import json

import tokenizers

from jlco.chat import deepseek_v32
from jlco.chat.output import fold
from jlco.server.assistant import (NamedShaper, ParsedShaper, RequiredShaper, chat_prompt,
                                   shaper_for)
from jlco.server.protocol import parse_chat
from jlco.server.text import TextCodec

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _stream(shaper, pieces):
    deltas = [d for p in pieces for d in shaper.feed(p)] + shaper.finish()
    return fold(deltas)


def test_forced_calls_stream_to_the_whole_message():
    named = NamedShaper("f")
    whole = named.message('{"a": 1}')
    got = _stream(NamedShaper("f"), ['{"a"', ": 1}"])
    assert got["tool_calls"][0]["function"] == whole["tool_calls"][0]["function"]
    req = RequiredShaper()
    text = json.dumps([{"name": "f", "parameters": {"x": [1]}}, {"name": "f", "parameters": {}}])
    msg = req.message(text)
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"x": [1]}', "{}"]
    assert msg["content"] is None and req.tool_calls_seen
    cut = RequiredShaper()
    assert cut.message('[{"name": "f", "par')["content"] == '[{"name": "f", "par'
    assert not cut.tool_calls_seen


def test_thinking_is_split_and_counted():
    codec = TextCodec.byte_level(512)
    tok = tokenizers.Tokenizer.from_str(codec.tokenizer.to_str())
    tok.add_tokens(["<think>", "</think>"])
    codec = dataclasses.replace(codec, tokenizer=tok)
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    shaper = ParsedShaper("deepseek_v32", "user: hi\nassistant: ", None, codec)
    msg = shaper.message("<think>AB</think>C")
    assert msg["reasoning_content"] == "AB" and msg["content"] == "C"
    assert shaper.reasoning_tokens([start, 65, 66, end, 67]) == 2
    assert NamedShaper("f").reasoning_tokens([start, 65, end]) == 0


def test_deepseek_v32_without_a_template_gets_its_own_encoding():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    p, msgs, add_gen = parse_chat(body)
    codec = dataclasses.replace(TextCodec.byte_level(512), chat_template=None)
    text = chat_prompt(codec, "deepseek_v32", msgs, add_gen, p)
    assert text == deepseek_v32.encode_messages(msgs, tools=TOOLS, thinking=False)
    assert isinstance(shaper_for(p, "deepseek_v32", text), ParsedShaper)
    forced, _, _ = parse_chat(dict(body, tool_choice="required"))
    assert isinstance(shaper_for(forced, "deepseek_v32", text), RequiredShaper)


def test_the_parser_can_be_another_familys():
    """--tool_call_parser glm_moe_dsa on a deepseek_v32 checkpoint: GLM-5's syntax parses."""
    p, _, _ = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    text = "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>"
    glm = shaper_for(p, "deepseek_v32", "", formats=("glm_moe_dsa", None))
    msg = glm.message(text)
    assert msg["tool_calls"][0]["function"]["name"] == "f"
    own = shaper_for(p, "deepseek_v32", "")
    assert "tool_calls" not in own.message(text)
