"""Fixtures of the engine tests' shared workload (tests/support/engine_workload.py). A test module
that defines its own `model` or `prompts` fixture overrides these."""

import pytest
from tests.support.engine_workload import make_model, make_prompts


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight model of the engine workload."""
    return make_model()


@pytest.fixture(scope="module")
def prompts():
    """The engine workload's four prompts (5, 70, 40 and 90 tokens)."""
    return make_prompts()
