"""The request checks of `jlco.server.protocol` on their own (no server): numbers read as
vLLM's pydantic models read them (2.0 is 2, null the default, a boolean no number), no-op
fields typed strictly, and the tokenizer routes' bodies."""

from __future__ import annotations

import pytest

from jlco.server.protocol import (
    ApiError,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)

CHAT = [{"role": "user", "content": "hi"}]


def test_integral_floats_are_integers():
    p = parse_completion({"prompt": "x", "max_tokens": 2.0, "seed": 1.0, "top_k": 4.0,
                          "n": 2.0, "logprobs": 3.0, "stop_token_ids": [5.0, 6]})
    assert (p.max_tokens, p.seed, p.top_k, p.n, p.logprobs) == (2, 1, 4, 2, 3)
    assert p.stop_token_ids == (5, 6)
    assert all(type(v) is int for v in (p.max_tokens, p.seed, p.top_k, p.n, p.logprobs,
                                         *p.stop_token_ids))
    c, _, _ = parse_chat({"messages": CHAT, "max_completion_tokens": 3.0, "logprobs": True,
                          "top_logprobs": 2.0})
    assert (c.max_tokens, c.logprobs) == (3, 2)


def test_null_is_the_default():
    p = parse_completion({"prompt": "x", "n": None, "max_tokens": None, "seed": None,
                          "echo": None, "logprobs": None, "presence_penalty": None,
                          "best_of": None, "stream": None, "top_k": None})
    assert (p.n, p.max_tokens, p.seed, p.echo, p.logprobs, p.top_k) == (1, 16, None, False,
                                                                        None, 0)


@pytest.mark.parametrize("field, value", [
    ("n", True), ("n", 1.5), ("max_tokens", True), ("max_tokens", 2.5), ("logprobs", True),
    ("logprobs", False), ("echo", 0), ("echo", 1), ("stream", 1), ("ignore_eos", "yes"),
    ("best_of", True), ("presence_penalty", False), ("repetition_penalty", True),
    ("skip_special_tokens", 1), ("use_beam_search", 0), ("min_tokens", False),
    ("stop_token_ids", [True]), ("stop_token_ids", [1.5]),
])
def test_booleans_are_not_numbers_nor_numbers_booleans(field, value):
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": "x", field: value})
    assert err.value.status == 400 and err.value.param == field
    assert field in err.value.message


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.0), ("presence_penalty", 0), ("repetition_penalty", 1),
    ("best_of", 1.0), ("skip_special_tokens", True), ("logit_bias", {}),
])
def test_no_op_values_pass(field, value):
    parse_completion({"prompt": "x", field: value})


def test_tokenize_bodies():
    t = parse_tokenize({"prompt": "héllo"})
    assert (t.prompt, t.messages, t.add_special_tokens) == ("héllo", None, True)
    t = parse_tokenize({"messages": CHAT, "add_generation_prompt": False})
    assert t.messages == CHAT and not t.add_special_tokens and not t.add_generation_prompt
    assert parse_tokenize({"prompt": "x", "add_special_tokens": False}).add_special_tokens \
        is False


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": 3}, "prompt"), ({"prompt": "x", "frob": 1}, "frob"),
    ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ({"messages": CHAT, "prompt": "x"}, "prompt"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": CHAT, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"prompt": "x", "model": 5}, "model"),
])
def test_bad_tokenize_bodies_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        parse_tokenize(body)
    assert err.value.status == 400 and err.value.param == param


def test_detokenize_bodies():
    assert parse_detokenize({"tokens": [1, 2.0], "model": "m"}) == ([1, 2], "m")
    for body, param in (({"tokens": [1, True]}, "tokens"), ({"tokens": [-1]}, "tokens"),
                        ({}, "tokens"), ({"tokens": [], "x": 1}, "x")):
        with pytest.raises(ApiError) as err:
            parse_detokenize(body)
        assert err.value.param == param
