"""Session-wide test settings, and the fixtures of the engine tests' shared workload
(tests/support/engine_workload.py; a test module that defines its own `model` or
`prompts` fixture overrides these).

JAX's persistent compilation cache is on for the whole run, as `jlco.generate` and
`jlco.serve` turn it on for users: the many tests that build an `Engine` (or a model)
compile the same programs again under new jitted functions, and the cache keys on the
program, so each distinct program is compiled once per run instead of once per test.
Its directory is `$JLCO_COMPILATION_CACHE_DIR` when set (e.g. `~/.cache/jlco/jax` for
warm reruns; '' turns the cache off), else a fresh temporary directory made by the main
pytest process for this run and shared by its xdist workers and by the subprocesses the
tests start: every run starts cold, as from a fresh clone, and leaves nothing behind."""

import os
import shutil
import tempfile

import pytest
from tests.support.engine_workload import make_model, make_prompts

from jlco.util import compile_cache

_RUN_CACHE: list[str] = []   # the directory this process made for the run, if any


def pytest_configure(config):
    # xdist workers inherit the environment of the main process, which configures first
    if compile_cache.ENV_VAR not in os.environ and not hasattr(config, "workerinput"):
        _RUN_CACHE.append(tempfile.mkdtemp(prefix="jlco-test-jax-cache-"))
        os.environ[compile_cache.ENV_VAR] = _RUN_CACHE[0]
    compile_cache.enable()


def pytest_unconfigure(config):
    for path in _RUN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight model of the engine workload."""
    return make_model()


@pytest.fixture(scope="module")
def prompts():
    """The engine workload's four prompts (5, 70, 40 and 90 tokens)."""
    return make_prompts()
