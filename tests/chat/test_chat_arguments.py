"""Argument values typed by the request's tool schemas (GLM writes them as bare text)."""

import pytest

from jlco.chat.arguments import (convert, is_plain_string, json_string_body,
                                 schema_properties, schema_types, to_json)


@pytest.mark.parametrize("raw, types, want", [
    ("42", ["integer"], 42),
    (" 42\n", ["integer"], 42),
    ("4.0", ["integer"], 4),
    ("4.5", ["integer"], "4.5"),            # does not fit: the text stays
    ("true", ["integer"], "true"),
    ("-1.5e3", ["number"], -1500.0),
    ("7", ["number"], 7),
    ("True", ["boolean"], True),
    ("false", ["boolean"], False),
    ("yes", ["boolean"], "yes"),
    ("null", ["null"], None),
    ('{"a": [1]}', ["object"], {"a": [1]}),
    ("{'a': (1, 2)}", ["object"], {"a": (1, 2)}),     # a Python literal is accepted
    ("[1, 'x']", ["array"], [1, "x"]),
    ("[1", ["array"], "[1"),
    ("12", ["string", "integer"], 12),      # non-string types are tried first
    ("soon", ["integer", "string"], "soon"),
    ("null", ["string", "null"], None),
    (" 3 ", ["string"], " 3 "),
    ("3", None, 3),                         # unknown: JSON if it parses
    ("not json", None, "not json"),
    ("x", ["weird"], "x"),
])
def test_convert(raw, types, want):
    assert convert(raw, types) == want


def test_schema_types():
    assert schema_types({"type": "integer"}) == ["integer"]
    assert schema_types({"type": ["string", "null"]}) == ["string", "null"]
    assert schema_types({"anyOf": [{"type": "integer"}, {"type": "string"},
                                   {"type": "integer"}]}) == ["integer", "string"]
    assert schema_types({"oneOf": [{"$ref": "#/x"}]}) is None
    assert schema_types({"description": "untyped"}) is None
    assert schema_types(None) is None


def test_plain_string_types_stream_as_text():
    assert is_plain_string(None) and is_plain_string(["string"])
    assert not is_plain_string(["string", "integer"]) and not is_plain_string(["object"])


def test_schema_properties_reads_openai_and_bare_tools():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {
        "properties": {"x": {"type": "integer"}}}}},
             {"name": "b"}, "junk", {"function": {"name": 3}}]
    assert schema_properties(tools) == {"a": {"x": {"type": "integer"}}, "b": {}}
    assert schema_properties(None) == {}


def test_escaping_pieces_joins_into_the_whole_escape():
    text = 'a"b\\c\n\td\x01é€😀'
    pieces = [json_string_body(ch) for ch in text]
    assert '"' + "".join(pieces) + '"' == to_json(text)
    assert to_json({"k": "é"}) == '{"k": "é"}'
