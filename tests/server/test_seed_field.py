"""`seed` as vLLM's pydantic models read it: an integer (2.0 is 2), null for none; a
boolean or a string is a 400 naming the field (it used to pass as seed 1, or fail as a
500 when the server added the choice index to it)."""

import pytest

from jlco.server.protocol import ApiError, parse_chat, parse_completion


@pytest.mark.parametrize("value", [True, "3", -1, 2 ** 32, 1.5])
def test_bad_seeds_name_the_field(value):
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": "x", "seed": value})
    assert err.value.status == 400 and err.value.param == "seed"
    with pytest.raises(ApiError, match="seed"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "seed": value})


def test_good_seeds():
    assert parse_completion({"prompt": "x", "seed": 3.0}).seed == 3
    assert parse_completion({"prompt": "x", "seed": None}).seed is None
    assert parse_completion({"prompt": "x", "seed": 2 ** 32 - 1}).seed == 2 ** 32 - 1
