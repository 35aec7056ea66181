"""Every option of the decode step in combination gives the tokens of the plainest engine.

{one device, mesh expert=2, mesh data=2} × {no drafts, one, two} × {offload off, in-jit
fetch, host-driven fetch} × {async scheduling on, off}: the engine workload (greedy, the
tiny f32 model with its MTP layer, requests joining as others leave) must emit exactly
the tokens of one device, no drafts, offload off, synchronous steps, with log-probs
within f32 summation-order noise (a mesh or a verify step of 1 + n rows may order some
sums differently), every request finished and every page back. The slow tier (CI) runs a
pairwise-covering subset (`composition.PAIRWISE`: every pair of levels of any two factors
in some combination, checked in the default tier) on the f32 and on the bf16 model
(log-probs within BF16_LOGPROB_ATOL); all 54 combinations are the `exhaustive` tier,
`python -m pytest -q -n 2 -m exhaustive tests` (27 minutes of one worker on 2 CPU cores,
too long for CI's 90 minutes beside the other tiers; run it when the decode step changes).
Each group runs in a subprocess with 2 forced CPU devices (tests/support/composition.py).
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.support import composition

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 1e-5   # f32 (tests/parallel/test_mesh.py)
# bf16: a mesh or a verify step of 1 + n rows orders some sums differently, and bf16
# keeps 8 bits of mantissa: one ulp at |log p| ~ 6 is 0.03. Measured: 0.015 at most.
BF16_LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def reference():
    return composition.run(composition.REFERENCE)


@pytest.fixture(scope="module")
def reference_bf16():
    return composition.run(composition.REFERENCE + ("bfloat16",))


def _run(combos) -> list[dict]:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tests.support.composition", json.dumps(combos)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _check(reference, combos, atol=LOGPROB_ATOL) -> None:
    got = _run(combos)
    assert [tuple(g["combo"]) for g in got] == [tuple(c) for c in combos]
    for g in got:
        mesh, drafts, fetch, async_on = g["combo"][:4]
        where = g["kind"]
        assert g["status"] == ["finished"] * len(g["tokens"]), where
        assert g["pages_left"] == 0, where
        assert g["tokens"] == reference["tokens"], where
        for a, b in zip(g["logprobs"], reference["logprobs"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < atol, where
        assert g["follow"] == async_on, where
        assert (f"fetch {'device' if fetch == 'off' else fetch}" in where
                and ("MTP" in where) == (drafts > 0)), where


def test_the_pairwise_subset_covers_every_pair_of_levels():
    """PAIRWISE (what the bf16 model runs) is a subset of FULL in which every two factors
    take every pair of their levels in some combination."""
    levels = (tuple(composition.MESHES), composition.DRAFTS, tuple(composition.FETCHES),
              composition.ASYNC)
    assert set(composition.PAIRWISE) <= set(composition.FULL)
    for i, j in itertools.combinations(range(len(levels)), 2):
        seen = {(c[i], c[j]) for c in composition.PAIRWISE}
        assert seen == set(itertools.product(levels[i], levels[j])), (i, j)


@pytest.mark.slow   # long on 2 CPU cores: the slow tier (pyproject.toml)
@pytest.mark.parametrize("mesh", list(composition.MESHES))
def test_pairwise_combinations_give_the_plain_tokens(reference, mesh):
    _check(reference, [c for c in composition.PAIRWISE if c[0] == mesh])


@pytest.mark.exhaustive   # all 54: not in CI (the module docstring says why)
@pytest.mark.parametrize("mesh", list(composition.MESHES))
@pytest.mark.parametrize("fetch", list(composition.FETCHES))
def test_every_combination_gives_the_plain_tokens(reference, mesh, fetch):
    _check(reference, [c for c in composition.FULL if c[0] == mesh and c[2] == fetch])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(composition.MESHES))
def test_bf16_pairwise_combinations_within_tolerance(reference_bf16, mesh):
    """The pairwise subset on the bf16 model: the bf16 reference's tokens, log-probs
    within BF16_LOGPROB_ATOL."""
    _check(reference_bf16, [c + ("bfloat16",) for c in composition.PAIRWISE if c[0] == mesh],
           BF16_LOGPROB_ATOL)
