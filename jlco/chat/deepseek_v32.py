"""DeepSeek-V3.2's chat encoding: an OpenAI-style conversation rendered as the prompt
text the checkpoint was trained on. V3.2 ships this format as Python
(encoding/encoding_dsv32.py in the model repository), not as a Jinja chat template, so
jlco carries its own implementation; the expected strings in tests/chat follow the
documented format and the official example conversation.

The shape of a prompt (special tokens are plain text here; the checkpoint's
tokenizer.json maps each to its id, so tokenize without adding a BOS again):

    <｜begin▁of▁sentence｜>{system}[\\n\\n## Tools ...]
    <｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜><think>            <- generation starts here

Thinking on: the prompt ends with `<think>` (the model writes its reasoning, then
`</think>`, then the answer); off ("chat"): it ends with `</think>`. Earlier turns never
show their reasoning; assistant turns after the last user message (a tool-call loop in
progress) show theirs as `{reasoning}</think>` in thinking mode. Tool calls are DSML
blocks after the turn's text, tool results a `<function_results>` block after it."""

from __future__ import annotations

import json
from typing import Any

from jlco.chat.arguments import to_json

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
ROLES = ("system", "developer", "user", "assistant", "tool")

_TOOLS_PROMPT = """## Tools

You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<{d}function_calls>" block like the following \
as part of your reply to the user:
<{d}function_calls>
<{d}invoke name="$FUNCTION_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$FUNCTION_NAME2">
...
</{d}invoke>
</{d}function_calls>

String and scalar parameters should be specified as is without any escaping or \
quotes, while lists and objects should use JSON format. The "string" attribute should \
be set to "true" for string type parameters and "false" for other types (numbers, \
booleans, arrays, objects).

If the thinking_mode is enabled, then after function results you should strongly \
consider outputting a thinking block. Here is an example:

<{d}function_calls>
...
</{d}function_calls>

<function_results>
...
</function_results>

{s}...thinking about results{e}

Here are the functions available in JSONSchema format:
<functions>
{functions}
</functions>
"""

_RESPONSE_FORMAT = ("## Response Format:\n\nYou MUST strictly adhere to the following "
                    "schema to reply:\n{schema}")


def encode_messages(messages: list[dict], *, tools: list | None = None,
                    thinking: bool = False, response_format: dict | None = None,
                    add_bos: bool = True) -> str:
    """The prompt for `messages` (OpenAI chat format: system / developer / user /
    assistant, with `tool_calls` and `content: null` allowed / tool). `tools` (OpenAI
    format) and `response_format` of the request join the leading system message (one
    is made, empty, when there is none). Bad input is a ValueError naming the field."""
    msgs = _with_request_extras(_checked(messages), tools, response_format)
    last_user = max((i for i, m in enumerate(msgs)
                     if m["role"] in ("user", "developer")), default=-1)
    out = [BOS] if add_bos else []
    for i, msg in enumerate(msgs):
        out.append(_render(i, msgs, last_user, thinking))
    return "".join(out)


def _checked(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be an object, not {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role: {m.get('role')!r} is not one of "
                             f"{', '.join(ROLES)}")
    return list(messages)


def _with_request_extras(msgs: list[dict], tools, response_format) -> list[dict]:
    """The request's tools / response_format carried by the leading system message,
    where the format puts them (the official example attaches them to messages[0])."""
    if not tools and not response_format:
        return msgs
    first = msgs[0]
    if first["role"] == "system" and not first.get("tools") \
            and not first.get("response_format"):
        msgs[0] = dict(first)
    else:
        msgs.insert(0, {"role": "system", "content": ""})
    if tools:
        msgs[0]["tools"] = tools
    if response_format:
        msgs[0]["response_format"] = response_format
    return msgs


def _text(value: Any, field: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise ValueError(f"{field}[{j}]: only text parts are supported "
                                 f"(allowed: {{\"type\": \"text\", \"text\": ...}})")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{field}: must be a string, null or a list of text parts")


def _instructions(msg: dict, i: int) -> str:
    """The tools and response-format sections a system / developer message carries."""
    out = ""
    if msg.get("tools"):
        out += "\n\n" + render_tools(msg["tools"], f"messages[{i}].tools")
    if msg.get("response_format"):
        out += "\n\n" + _RESPONSE_FORMAT.format(schema=to_json(msg["response_format"]))
    return out


def render_tools(tools: list, field: str = "tools") -> str:
    """The system-prompt section that teaches the DSML syntax and lists the functions
    (each tool's `function` object as one line of JSON)."""
    if not isinstance(tools, list):
        raise ValueError(f"{field}: must be a list of tools")
    lines = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or tool.get("type", "function") != "function":
            raise ValueError(f"{field}[{j}]: must be {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ..., ...}}}}")
        lines.append(to_json(fn))
    return _TOOLS_PROMPT.format(d=DSML, s=THINK_START, e=THINK_END,
                                functions="\n".join(lines))


def _render(i: int, msgs: list[dict], last_user: int, thinking: bool) -> str:
    msg, role = msgs[i], msgs[i]["role"]
    field = f"messages[{i}].content"
    if role == "system":
        return _text(msg.get("content"), field) + _instructions(msg, i)
    if role in ("user", "developer"):
        body = _text(msg.get("content"), field)
        if role == "developer":
            if not body:
                raise ValueError(f"{field}: a developer message needs content")
            body = _instructions(msg, i) + "\n\n# The user's message is: " + body
        opens = thinking and i == last_user
        return USER + body + ASSISTANT + (THINK_START if opens else THINK_END)
    if role == "tool":
        return _render_tool_result(i, msgs, last_user, thinking)
    return _render_assistant(i, msg, last_user, thinking)


def _render_assistant(i: int, msg: dict, last_user: int, thinking: bool) -> str:
    out = ""
    if thinking and i > last_user:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        out += _text(reasoning, f"messages[{i}].reasoning_content") + THINK_END
    out += _text(msg.get("content"), f"messages[{i}].content")
    calls = msg.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls: must be a list")
        invokes = [_render_call(c, f"messages[{i}].tool_calls[{j}]")
                   for j, c in enumerate(calls)]
        out += (f"\n\n<{DSML}function_calls>\n" + "\n".join(invokes)
                + f"\n</{DSML}function_calls>")
    return out + EOS


def _render_call(call: Any, field: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{field}.function: must be an object with a name and "
                         f"arguments")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"{field}.function.arguments: not valid JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"{field}.function.arguments: must be a JSON object")
    params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
              f"{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>"
              for k, v in args.items()]
    return (f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params)
            + f"\n</{DSML}invoke>")


def _render_tool_result(i: int, msgs: list[dict], last_user: int, thinking: bool) -> str:
    """Results of one assistant turn's calls share one <function_results> block, in
    the order of the calls; the block is followed by the thinking marker the next
    generation starts from."""
    first = i
    while first > 0 and msgs[first - 1]["role"] == "tool":
        first -= 1
    owner = msgs[first - 1] if first > 0 else None
    calls = owner.get("tool_calls") if owner and owner["role"] == "assistant" else None
    if not calls:
        raise ValueError(f"messages[{i}]: a tool result must follow an assistant "
                         f"message with tool_calls")
    order = i - first + 1
    if order > len(calls):
        raise ValueError(f"messages[{i}]: more tool results than the "
                         f"{len(calls)} tool_calls of messages[{first - 1}]")
    last_of_run = i + 1 == len(msgs) or msgs[i + 1]["role"] != "tool"
    if last_of_run and order < len(calls):
        raise ValueError(f"messages[{first - 1}].tool_calls: {len(calls)} calls but "
                         f"only {order} tool results follow")
    out = "\n\n<function_results>" if order == 1 else ""
    out += "\n<result>" + _text(msgs[i].get("content"), f"messages[{i}].content") \
        + "</result>"
    if order == len(calls):
        opens = thinking and i >= last_user
        out += "\n</function_results>\n\n" + (THINK_START if opens else THINK_END)
    return out
