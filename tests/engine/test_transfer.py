"""PD disaggregation, colocated: prefill on engine A, export, import into engine B, claim,
decode — the tokens equal decoding on A alone; payloads that do not fit B are refused
naming the tensor; an import nobody claims is swept with everything given back."""

from __future__ import annotations

import numpy as np
import pytest
from tests.support.engine_workload import BASE

from jlco.engine.core import Engine
from jlco.engine.scheduler import RequestError
from jlco.engine.transfer import PrefilledRequest

PROMPT = [(13 * i + 5) % 500 for i in range(70)]


@pytest.fixture(scope="module")
def exported(model):
    a = Engine(BASE, model)                  # the prefill node: latent cache on device
    payload = a.export_prefill(PROMPT, 8).to_bytes()
    alone = a.generate([PROMPT], 8, temperature=0.7, seed=5)[0].tokens
    return payload, alone


@pytest.mark.parametrize("offload", [False, True])
def test_import_and_claim_decodes_as_the_prefill_node_alone(model, exported, offload):
    payload, alone = exported
    b = Engine(BASE.replace(cache__offload=offload), model)
    other = b.submit([(3 * i) % 500 for i in range(40)], 6)      # B is busy meanwhile
    p = PrefilledRequest.from_bytes(payload)
    assert p.prompt == PROMPT and p.max_new_tokens == 8 and p.record.shape[1] == 32
    req = b.import_prefill(p)
    assert b.num_imports == 1 and not req.tokens
    b.step()
    b.step()
    assert not req.tokens, "an unclaimed import does not decode"
    b.claim(req.id, PROMPT, 8, temperature=0.7, seed=5)
    b.run()
    assert req.tokens == alone and req.finish_reason == "length"
    assert len(other.tokens) == 6
    b.check_no_leaks()
    if offload:
        assert b.runner.warmup_rows > 0 and b.scheduler.pages.used_pages == 0


def test_claim_checks_prompt_and_room(model, exported):
    b = Engine(BASE, model)
    req = b.import_prefill(PrefilledRequest.from_bytes(exported[0]))
    with pytest.raises(RequestError, match="prompt"):
        b.claim(req.id, PROMPT[:-1], 4)
    with pytest.raises(RequestError, match="reserved room for 8"):
        b.claim(req.id, PROMPT, 9)
    with pytest.raises(RequestError, match="prefill_id"):
        b.claim(req.id + 100, PROMPT, 4)


def test_unclaimed_import_is_swept(model, exported):
    b = Engine(BASE.replace(cache__offload=True), model)
    b.import_prefill(PrefilledRequest.from_bytes(exported[0]))
    assert b.scheduler.pages.used_pages > 0
    assert b.sweep(ttl_s=3600) == 0
    assert b.sweep(ttl_s=0.0) == 1 and b.orphans_swept == 1
    assert b.scheduler.pages.used_pages == 0 and b.scheduler.slots == [None, None]
    b.check_no_leaks()


def test_payloads_that_do_not_fit_are_refused(model, exported):
    payload = exported[0]
    with pytest.raises(ValueError, match="safetensors"):
        PrefilledRequest.from_bytes(payload[:4])
    with pytest.raises(ValueError, match="offsets|header"):
        PrefilledRequest.from_bytes(payload[:-10])
    p = PrefilledRequest.from_bytes(payload)
    fp8 = BASE.replace(cache__kv_format="fp8")
    with pytest.raises(ValueError, match=r"latent\.0: uint8\[70, 576\] .* allowed uint8\[70, 164\]"):
        p.check(fp8)
    p.hidden = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="hidden"):
        p.check(BASE)
    b = Engine(BASE, model)
    p = PrefilledRequest.from_bytes(payload)
    p.index_k = p.index_k[:-1]
    with pytest.raises(ValueError, match="index_k: 3 layers"):
        b.import_prefill(p)
    b.check_no_leaks()
    assert b.scheduler.slots == [None, None]
