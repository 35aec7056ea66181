"""Tool-call parsers for DeepSeek-V3.2 (DSML) and GLM-5 (<tool_call>): whole responses,
and the streamed deltas, which must fold into exactly the whole result however the
text is cut (every split point, one character at a time, random chunkings)."""

import itertools
import json
import random

import pytest

from jlco.chat.tool_parsers import (DeepSeekV32ToolParser, Glm5ToolParser, PARSERS,
                                    ToolCall, collect_deltas, parser_for)

D = "｜DSML｜"


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def tool(name, **props):
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props}}}


TOOLS = [tool("get_weather", city={"type": "string"}, days={"type": "integer"},
              metric={"type": "boolean"}, where={"type": "object"},
              hours={"type": "array"}, temp={"type": "number"},
              when={"type": ["integer", "string"]}),
         tool("now")]


def dsml_param(k, v, s):
    return f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>'


DSML_TEXT = (
    "Let me check the weather.\n\n"
    f"<{D}function_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    + dsml_param("city", 'São "Paulo"\n\\x', "true") + "\n"
    + dsml_param("days", "3", "false") + "\n"
    + dsml_param("where", '{"lat": 1.5, "tags": ["a", null]}', "false") + "\n"
    + dsml_param("metric", "true", "false") + "\n"
    f"</{D}invoke>\n"
    f'<{D}invoke name="now">\n\n</{D}invoke>\n'
    f"</{D}function_calls>")

DSML_CALLS = [("get_weather", {"city": 'São "Paulo"\n\\x', "days": 3,
                               "where": {"lat": 1.5, "tags": ["a", None]},
                               "metric": True}),
              ("now", {})]

GLM5_TEXT = (
    "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich "
    "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>metric"
    "</arg_key><arg_value>False</arg_value><arg_key>where</arg_key><arg_value>"
    "{'lat': 2}</arg_value><arg_key>hours</arg_key><arg_value>[1, 2]</arg_value>"
    "<arg_key>temp</arg_key><arg_value>-1.25</arg_value><arg_key>when</arg_key>"
    "<arg_value>soon</arg_value></tool_call>Between.<tool_call>now</tool_call>")

GLM5_CALLS = [("get_weather", {"city": "Zürich ", "days": 3, "metric": False,
                               "where": {"lat": 2}, "hours": [1, 2], "temp": -1.25,
                               "when": "soon"}),
              ("now", {})]

# GLM-4.5 / 4.6 layout: newlines between the parts
GLM45_TEXT = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo"
              "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
              "</tool_call>\n")

CASES = [(DeepSeekV32ToolParser, DSML_TEXT, "Let me check the weather.", DSML_CALLS),
         (Glm5ToolParser, GLM5_TEXT, "Checking.Between.", GLM5_CALLS),
         (Glm5ToolParser, GLM45_TEXT, "", [("get_weather", {"city": "Oslo", "days": 2})])]


def streamed(cls, text, cuts, tools=TOOLS):
    p = cls(tools, ids())
    deltas, last = [], 0
    for cut in list(cuts) + [len(text)]:
        deltas += p.feed(text[last:cut])
        last = cut
    return deltas + p.finish()


def whole(cls, text, tools=TOOLS):
    return cls(tools, ids()).parse(text)


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_whole_response(cls, text, content, calls):
    got_content, got = whole(cls, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert [c.id for c in got] == [f"call_{i}" for i in range(len(calls))]
    # the arguments string is exactly the JSON of the object (json.dumps' spacing)
    assert [c.arguments for c in got] == [json.dumps(a, ensure_ascii=False)
                                          for _, a in calls]


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_every_split_point_gives_the_whole_result(cls, text, content, calls):
    want = whole(cls, text)
    for i in range(len(text) + 1):
        assert collect_deltas(streamed(cls, text, [i])) == want, i


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_one_character_at_a_time_and_random_chunks(cls, text, content, calls):
    want = whole(cls, text)
    assert collect_deltas(streamed(cls, text, range(1, len(text)))) == want
    rng = random.Random(23)
    for _ in range(150):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 25)))
        assert collect_deltas(streamed(cls, text, cuts)) == want, cuts


@pytest.mark.parametrize("cls, text, content, calls", CASES)
def test_delta_shapes_follow_openai_streaming(cls, text, content, calls):
    deltas = streamed(cls, text, range(1, len(text)))
    seen = {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        if "content" in d:
            assert d["content"]
            continue
        (tc,) = d["tool_calls"]
        if tc["index"] not in seen:     # first delta of a call: id, type, name
            assert tc["index"] == len(seen)
            assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
            seen[tc["index"]] = tc["id"]
        else:                           # then argument fragments only
            assert set(tc) == {"index", "function"}
            assert set(tc["function"]) == {"arguments"} and tc["function"]["arguments"]
            assert tc["index"] == max(seen)  # calls do not interleave
    assert len(seen) == len(calls)


def test_long_string_values_stream_before_they_close():
    """A file's content in a string argument reaches the client as it is generated."""
    p = DeepSeekV32ToolParser(TOOLS, ids())
    head = f'<{D}function_calls>\n<{D}invoke name="get_weather">\n' \
           f'<{D}parameter name="city" string="true">'
    out = p.feed(head) + p.feed("line one\n") + p.feed("line two")
    args = "".join(tc["function"]["arguments"] for d in out for tc in d["tool_calls"])
    assert args == '{"city": "line one\\nline two'
    g = Glm5ToolParser(TOOLS, ids())
    out = g.feed("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ber")
    assert collect_deltas(out)[1][0].arguments == '{"city": "Ber'


def test_typed_values_wait_for_their_end():
    g = Glm5ToolParser(TOOLS, ids())
    out = g.feed("<tool_call>get_weather<arg_key>days</arg_key><arg_value>1")
    assert collect_deltas(out)[1][0].arguments == '{"days": '
    assert collect_deltas(g.feed("2</arg_value></tool_call>"))[1][0].arguments == "12}"


@pytest.mark.parametrize("cls", [DeepSeekV32ToolParser, Glm5ToolParser])
@pytest.mark.parametrize("text", [
    "Plain answer.\n\n", "a < b and <tool or <｜DSML｜ are just text: <",
    "  leading and trailing  ", "", "<tool_call", f"x\n\n<{D}function_call"])
def test_text_without_calls_is_content_exactly(cls, text):
    assert whole(cls, text) == (text, [])
    for i in range(len(text) + 1):
        assert collect_deltas(streamed(cls, text, [i])) == (text, [])


def test_glm_without_schemas_keeps_values_as_strings():
    content, calls = whole(Glm5ToolParser, GLM45_TEXT, tools=None)
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "days": "2"}
    # a schema type the value does not fit keeps the text too
    content, calls = whole(Glm5ToolParser, "<tool_call>get_weather<arg_key>days"
                           "</arg_key><arg_value>many</arg_value></tool_call>")
    assert json.loads(calls[0].arguments) == {"days": "many"}


def test_dsml_non_string_value_that_is_not_json_stays_text():
    text = (f'<{D}function_calls>\n<{D}invoke name="x">\n'
            + dsml_param("v", "not json", "false") + f"\n</{D}invoke>\n</{D}function_calls>")
    assert json.loads(whole(DeepSeekV32ToolParser, text)[1][0].arguments) == {"v": "not json"}


@pytest.mark.parametrize("cls, text", [
    (DeepSeekV32ToolParser, f'Hi\n\n<{D}function_calls>\n<{D}invoke name="get_weather">'
                            f'\n<{D}parameter name="city" string="true">Li'),
    (DeepSeekV32ToolParser, f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
                            f'<{D}parameter name="days" string="false">4</{D}param'),
    (Glm5ToolParser, "Hi<tool_call>get_weather<arg_key>city</arg_key><arg_value>Li"),
    (Glm5ToolParser, "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4</arg"),
    (Glm5ToolParser, "<tool_call>get_weather<arg_key>ci"),
])
def test_a_response_cut_off_inside_a_call_still_has_json_arguments(cls, text):
    want = whole(cls, text)
    assert len(want[1]) == 1 and isinstance(json.loads(want[1][0].arguments), dict)
    for i in range(len(text) + 1):
        assert collect_deltas(streamed(cls, text, [i])) == want


def test_cut_off_inside_the_name_makes_no_call():
    assert whole(Glm5ToolParser, "ok<tool_call>get_wea") == ("ok", [])
    assert whole(DeepSeekV32ToolParser, f'ok\n\n<{D}function_calls>\n<{D}invoke na') \
        == ("ok", [])


def test_parse_leaves_streaming_state_alone_and_finish_ends_the_response():
    p = Glm5ToolParser(TOOLS, ids())
    first = p.feed("Hel")
    assert p.parse("other<tool_call>now</tool_call>")[0] == "other"
    rest = p.feed("lo") + p.finish()
    assert collect_deltas(first + rest) == ("Hello", [])
    assert p.finish() == []
    with pytest.raises(ValueError, match="finished"):
        p.feed("more")


def test_tool_call_as_openai():
    c = ToolCall("call_1", "f", '{"a": 1}')
    assert c.as_openai() == {"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_default_ids_are_unique():
    _, calls = Glm5ToolParser().parse("<tool_call>a</tool_call><tool_call>b</tool_call>")
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_registry_and_parser_for():
    assert set(PARSERS) == {"deepseek_v32", "glm5"}
    assert type(parser_for("deepseek_v32")) is DeepSeekV32ToolParser
    p = parser_for("glm_moe_dsa", TOOLS)
    assert type(p) is Glm5ToolParser and p.tools is TOOLS
    with pytest.raises(ValueError, match=r"model_type: 'llama' .*deepseek_v32, glm_moe_dsa"):
        parser_for("llama")
