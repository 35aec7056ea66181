"""`SamplingParams` alone, without a model or jax: each field checked when the value is
made (the error names it), the engine-side check (`check`), the defaults, and the one
frozen value travelling on the scheduler's Request."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from jlco.engine.scheduler import RequestError, Scheduler
from jlco.sampling.params import MAX_LOGPROBS, SamplingParams, sampling_params
from jlco.sampling.penalties import Penalties

VOCAB = 100


class _Constraint:
    stopped = False

    def fill(self, row):
        row[:] = -1

    def consume(self, token):
        pass


@pytest.mark.parametrize("fields, field, allowed", [
    (dict(temperature=-1.0), "temperature", "0 (greedy) .. 100"),
    (dict(temperature=101), "temperature", "0 (greedy) .. 100"),
    (dict(temperature="0"), "temperature", "0 (greedy) .. 100"),
    (dict(temperature=True), "temperature", "0 (greedy) .. 100"),
    (dict(seed=-1), "seed", "0..2**32-1"),
    (dict(seed=2 ** 32), "seed", "0..2**32-1"),
    (dict(seed=1.5), "seed", "0..2**32-1"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_k=-1), "top_k", ">= 0"),
    (dict(top_k=2.0), "top_k", ">= 0"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(min_p=-0.1), "min_p", "[0, 1]"),
    (dict(top_logprobs=MAX_LOGPROBS + 1), "top_logprobs", f"0..{MAX_LOGPROBS}"),
    (dict(top_logprobs=-1), "top_logprobs", f"0..{MAX_LOGPROBS}"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs", f"0..{MAX_LOGPROBS}"),
    (dict(prompt_logprobs=True), "prompt_logprobs", f"0..{MAX_LOGPROBS}"),
    (dict(stop_token_ids=5), "stop_token_ids", "token ids"),
    (dict(constraint=object()), "constraint", "TokenConstraint or None"),
])
def test_each_bad_field_is_named_when_made(fields, field, allowed):
    with pytest.raises(RequestError) as info:
        SamplingParams(**fields)
    err = info.value
    assert err.field == field and err.kind == "invalid"
    assert str(err).startswith(f"{field}=") and allowed in str(err)


@pytest.mark.parametrize("params, max_new, field", [
    (SamplingParams(stop_token_ids=[VOCAB]), 4, "stop_token_ids"),
    (SamplingParams(penalties=Penalties(presence=3.0)), 4, "presence_penalty"),
    (SamplingParams(penalties=Penalties(repetition=0.0)), 4, "repetition_penalty"),
    (SamplingParams(penalties=Penalties(min_tokens=5)), 4, "min_tokens"),
    (SamplingParams(penalties=Penalties(logit_bias=((VOCAB, 1.0),))), 4, "logit_bias"),
    (SamplingParams(penalties="x"), 4, "penalties"),
])
def test_the_engine_side_check_names_the_field(params, max_new, field):
    with pytest.raises(RequestError, match=field) as info:
        params.check(VOCAB, max_new)
    assert info.value.field == field


def test_defaults_are_greedy_unfiltered_unpenalised():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.stop_token_ids) == \
        (0.0, 1.0, 0, 0.0, 0, ())
    assert (p.top_logprobs, p.prompt_logprobs, p.penalties, p.constraint) == \
        (0, None, Penalties(), None)
    assert not p.penalties.active
    assert sampling_params() == p


def test_fields_are_normalised_once_and_the_check_caps_top_k():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, stop_token_ids=[np.int64(3), 5],
                       top_k=10 * VOCAB, top_logprobs=None, penalties=None)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.min_p) is float
    assert p.stop_token_ids == (3, 5) and all(type(t) is int for t in p.stop_token_ids)
    assert p.top_logprobs == 0 and p.penalties == Penalties()
    checked = p.check(VOCAB, 4)
    assert checked.top_k == VOCAB and p.top_k == 10 * VOCAB      # a copy; p unchanged
    assert dataclasses.replace(checked, top_k=p.top_k) == p
    c = _Constraint()
    assert SamplingParams(constraint=c).check(VOCAB, 4).constraint is c


def test_the_value_is_frozen():
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    with pytest.raises(TypeError):
        SamplingParams(0.5)      # keyword only: no field taken for another by position


def test_params_or_keywords_not_both():
    p = SamplingParams(seed=3)
    assert sampling_params(p) is p
    assert sampling_params(seed=3) == p
    with pytest.raises(TypeError, match="not both"):
        sampling_params(p, seed=4)
    with pytest.raises(TypeError, match="SamplingParams"):
        sampling_params(0.7)
    with pytest.raises(TypeError):
        sampling_params(temprature=0.7)


def test_the_params_travel_on_the_request():
    s = Scheduler(2, 32, VOCAB)
    p = SamplingParams(temperature=0.7, seed=9, top_k=10 * VOCAB, stop_token_ids=[4],
                       top_logprobs=2, penalties=Penalties(presence=0.5))
    req = s.add([1, 2, 3], 4, p)
    assert req.params == p.check(VOCAB, 4) and req.params.top_k == VOCAB
    assert s.add([1], 1).params == SamplingParams()
    plan = s.schedule()
    s.append(plan.prefills[0], 4, -0.5)       # its stop id, read from its params
    assert req.finish_reason == "stop"


def test_a_bad_field_queues_nothing():
    s = Scheduler(2, 32, VOCAB)
    with pytest.raises(RequestError, match="stop_token_ids"):
        s.add([1, 2], 2, SamplingParams(stop_token_ids=[VOCAB]))
    with pytest.raises(TypeError):
        s.add([1, 2], 2, 0.7)
    assert not s.has_work and s.requests == {}


def test_params_import_no_jax():
    code = ("import sys, jlco.sampling.params; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
