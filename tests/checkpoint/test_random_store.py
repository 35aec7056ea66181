"""The random-weight model store (`jlco.checkpoint.random_store`): with the compilation
cache on, the second build reads the arrays back, bit for bit the eagerly built model
(float32 and bfloat16); with the cache off nothing is written."""

import pytest

from jlco.util import compile_cache
from tests.support.cli import run

CODE = """
import dataclasses, sys
import jax, numpy as np
from flax import nnx
from jlco.util import compile_cache
compile_cache.enable()
from jlco.checkpoint import random_store as rs
from jlco.config import load_config
from jlco.model.decoder import DeepseekV32
base = load_config("configs/tiny.py").model
for dtype in ("float32", "bfloat16"):
    m = dataclasses.replace(base, dtype=dtype)
    first, again = rs.random_model(m, 1), rs.random_model(m, 1)
    eager = DeepseekV32(m, rngs=nnx.Rngs(1))
    want = jax.tree.leaves(nnx.state(eager))
    for got in (first, again):
        leaves = jax.tree.leaves(nnx.state(got))
        assert nnx.graphdef(got) == nnx.graphdef(eager), dtype
        assert len(leaves) == len(want) and all(
            a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(leaves, want)), dtype
d = rs.store_dir()
print(0 if d is None else len(list(d.glob("*.npz"))))
"""


def test_second_build_reads_the_same_bits(tmp_path):
    r = run("-c", CODE, env={compile_cache.ENV_VAR: str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "2"          # one entry per dtype
    assert len(list((tmp_path / "c" / "random_models").glob("*.npz"))) == 2


@pytest.mark.slow   # a second interpreter: the slow tier; the cache-on test stays default
def test_nothing_is_stored_with_the_cache_off():
    r = run("-c", CODE, env={compile_cache.ENV_VAR: ""})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "0"
