"""`jlco.native`: the small-M f32 matmul kernels (XLA FFI custom calls on CPU) against
their plain-jnp reference, the batch invariance they promise, their build errors, and
the model and engine routing decode-sized products through them; the top-k against
`lax.top_k`, bit for bit; the indexer's scores against their reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlco import native
from jlco.config import load_config
from jlco.engine import runner
from jlco.engine.core import Engine
from jlco.model import kv_cache
from jlco.model.decoder import DeepseekV32, fuse_projections, use_native_matmuls
from jlco.model.moe import unstack_experts
from tests.support.engine_workload import BASE, make_model

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu",
                       reason="XLA:CPU kernels: the default backend here is not CPU"),
    pytest.mark.skipif(jax.default_backend() == "cpu" and not native.available(),
                       reason="no C++ compiler here to build jlco.native"),
]

SHAPES = [            # (B, M, K, N): tails of every unroll (k by 4 or 16 lanes, n by 4)
    (1, 1, 512, 2048), (1, 4, 512, 2048), (8, 4, 128, 512), (8, 3, 512, 128),
    (2, 8, 37, 300), (1, 5, 19, 7), (1, 2, 1, 1), (3, 6, 64, 1), (3, 2, 0, 5),
]


def _operands(b, m, k, n, transposed, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, m, k), np.float32)
    w = rng.standard_normal((b, n, k) if transposed else (b, k, n), np.float32)
    return jnp.asarray(x), jnp.asarray(w)


def _run(x, w, transposed):
    return jax.jit(native.batched, static_argnums=2)(x, w, transposed)


@pytest.mark.parametrize("transposed", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_reference(shape, transposed):
    x, w = _operands(*shape, transposed)
    out = _run(x, w, transposed)
    ref = native.matmul_ref(x, w, transposed)
    assert out.shape == ref.shape and out.dtype == jnp.float32
    scale = float(jnp.max(jnp.abs(ref))) if ref.size else 1.0
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * max(scale, 1.0) * 8)


@pytest.mark.parametrize("transposed", [False, True], ids=["nn", "nt"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(transposed):
    """Batch invariance: each row alone, and the batch entries alone, give the same bits
    as the whole call (the thread split and M change nothing)."""
    x, w = _operands(4, 7, 300, 1000, transposed, seed=1)
    whole = np.asarray(_run(x, w, transposed))
    for m in range(7):
        np.testing.assert_array_equal(np.asarray(_run(x[:, m:m + 1], w, transposed))[:, 0],
                                      whole[:, m])
    np.testing.assert_array_equal(np.asarray(_run(x[2:3], w[2:3], transposed))[0], whole[2])


def test_linear_flattens_leading_rows_and_vmap_works():
    x, w = _operands(1, 6, 64, 96, False, seed=2)
    x3 = x[0].reshape(2, 3, 64)
    out = jax.jit(native.linear)(x3, w[0])
    np.testing.assert_allclose(out, np.asarray(x3) @ np.asarray(w[0]), rtol=1e-5, atol=1e-5)
    mapped = jax.jit(jax.vmap(native.linear, in_axes=(0, None)))(x3, w[0])
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(out))


def test_supports_only_f32_and_small_row_counts():
    w = jnp.zeros((8, 4), jnp.float32)
    assert native.supports(jnp.zeros((2, 4, 8)), w)
    assert not native.supports(jnp.zeros((9, 8)), w)                  # more than MAX_ROWS
    assert not native.supports(jnp.zeros((0, 8)), w)
    assert not native.supports(jnp.zeros((2, 8), jnp.bfloat16), w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="M=9, allowed 1..8"):
        native.batched(jnp.zeros((1, 9, 8)), jnp.zeros((1, 8, 4)))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_other_platforms_lower_to_xlas_dot(platform):
    x, w = _operands(2, 4, 16, 32, False)
    text = jax.jit(native.batched).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
    assert "jlco_matmul" not in text and "dot_general" in text
    cpu = jax.jit(native.batched).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "jlco_matmul_nn" in cpu


def test_a_failed_compile_says_why(monkeypatch, tmp_path):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(native.NativeUnavailable, match="compiling bad.cc failed"):
        native._build()
    assert not list(tmp_path.glob("jlco/native/*.so"))


def test_cpu_matmul_choices():
    assert runner.native_matmul("xla") is False
    assert runner.native_matmul("native") is True
    assert runner.native_matmul("auto") is True


def _decode_logits(model, cfg, tokens, cache):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tokens):
        m = nnx.merge(graphdef, state)
        h, _ = m(tokens, cache, impl="xla")
        return m.logits(h)

    lowered = step.lower(state, cache, tokens)
    return step(state, cache, tokens), lowered.as_text()


@pytest.fixture(scope="module")
def routed_models():
    """The CPU engine's model (experts unstacked, projections fused), a copy of it with
    `use_native_matmuls`, and a cache of 3 requests of 20 tokens: built once for both
    cases below (neither changes them: no argument is donated)."""
    cfg = load_config("configs/tiny.py")
    model = DeepseekV32(cfg.model, rngs=nnx.Rngs(0))
    unstack_experts(model)
    fuse_projections(model)
    fast = nnx.clone(model)
    assert use_native_matmuls(fast) > 0 and use_native_matmuls(fast) == 0
    b = 3
    cache = kv_cache.init_cache(cfg, batch=b, max_len=64)
    warm = jax.random.randint(jax.random.PRNGKey(1), (b, 20), 0, cfg.model.vocab_size)
    graphdef, state = nnx.split(model)
    _, cache = jax.jit(lambda st, c, t: nnx.merge(graphdef, st)(t, c, impl="xla"))(
        state, cache, warm)
    return cfg, model, fast, cache, b


@pytest.mark.parametrize("s", [1, 2], ids=["decode", "two_query_tokens"])
def test_the_model_routes_decode_sized_products_through_the_kernels(routed_models, s):
    """The CPU engine's model with and without `use_native_matmuls`: the same logits
    within f32 summation order; the projections, experts, W_UK and W_UV of a decode-sized
    step run the kernels, and a prefill-sized step (more than MAX_ROWS rows) keeps XLA's
    dot for all but its 8-row expert tiles."""
    cfg, model, fast, cache, b = routed_models
    tokens = jax.random.randint(jax.random.PRNGKey(2), (b, s), 0, cfg.model.vocab_size)
    ref, ref_text = _decode_logits(model, cfg, tokens, cache)
    out, text = _decode_logits(fast, cfg, tokens, cache)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert "jlco_matmul" not in ref_text
    assert "jlco_matmul_nn" in text and "jlco_matmul_nt" in text
    big = _decode_logits(fast, cfg, jnp.zeros((b, 4), jnp.int32), cache)[1]   # 12 rows
    calls = re.findall(r"custom_call @jlco_matmul_n[nt].*: \(tensor<\d+x(\d+)x", big)
    assert all(int(m) <= native.MAX_ROWS for m in calls)    # expert tiles of 8 rows only
    assert "dot_general" in big and "tensor<3x4x" in big


def test_the_engine_uses_the_kernels_per_cpu_matmul():
    cfg = BASE
    for choice, expect in (("xla", False), ("auto", True)):
        eng = Engine(cfg.replace(engine__cpu_matmul=choice), make_model())
        flags = {n.native for _, n in nnx.iter_graph(nnx.merge(eng.runner.graphdef,
                                                                eng.runner.state))
                 if hasattr(type(n), "native")}
        assert flags == {expect}


def _bits(a):
    a = np.asarray(a)
    return a.view(np.int32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("shape,k", [((4, 1, 2112), 256), ((3, 5, 300), 300), ((2, 7), 3),
                                     ((1, 33000), 256), ((2, 64), 0)])
def test_top_k_is_lax_top_k_bit_for_bit(shape, k):
    """Values and positions equal lax.top_k's, ties, signed zeros, -inf and NaN included."""
    rng = np.random.default_rng(3)
    s = rng.standard_normal(shape).astype(np.float32)
    cols = np.arange(0, shape[-1] - 1, 7)
    s[..., cols] = s[..., cols + 1]                                    # ties
    s[..., :3] = s[..., -3:] = 0.0
    s[..., 1] = s[..., -2] = -0.0
    s.reshape(-1, shape[-1])[:, 4] = -np.inf
    s.reshape(-1, shape[-1])[0, 5] = np.nan
    x = jnp.asarray(s)
    out = jax.jit(native.top_k, static_argnums=1)(x, k)
    ref = jax.jit(jax.lax.top_k, static_argnums=1)(x, k)
    assert "jlco_top_k" in jax.jit(native.top_k, static_argnums=1).lower(x, k).as_text()
    for a, b in zip(out, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_top_k_under_vmap_and_on_other_platforms():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 2, 50)), jnp.float32)
    out = jax.jit(jax.vmap(lambda r: native.top_k(r, 10)))(x)
    for a, b in zip(out, jax.lax.top_k(x, 10), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    for platform in ("cuda", "tpu"):
        text = jax.jit(lambda s: native.top_k(s, 10)).trace(x).lower(
            lowering_platforms=(platform,)).as_text()
        assert "jlco_top_k" not in text


@pytest.mark.parametrize("b,s,heads,d,n,key_dtype", [
    (4, 1, 16, 128, 2112, jnp.bfloat16), (2, 3, 64, 128, 700, jnp.float32),
    (1, 2, 5, 7, 9, jnp.bfloat16), (2, 1, 33, 16, 5, jnp.float32)])
def test_indexer_scores_equal_the_reference(b, s, heads, d, n, key_dtype):
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, s, heads, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, s, heads)), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((b, n, d)), key_dtype)
    assert native.indexer_scores_supported(q, keys)
    out = jax.jit(native.indexer_scores)(q, w, keys)
    ref = native.indexer_scores_ref(q, w, keys)
    assert out.shape == (b, s, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(ref))))
    # Each score depends on its query and key only: a slice of the keys, one request
    # or one query scores to the same bits.
    whole = np.asarray(out)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(native.indexer_scores)(q, w, keys[:, 1:n - 1 or None])),
        whole[:, :, 1:n - 1 or None])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(native.indexer_scores)(q[-1:, -1:], w[-1:, -1:], keys[-1:])),
        whole[-1:, -1:])


def test_indexer_scores_scope():
    q = jnp.zeros((1, 1, 16, 8), jnp.float32)
    assert not native.indexer_scores_supported(q, jnp.zeros((1, 4, 8), jnp.uint8))   # fp8
    assert not native.indexer_scores_supported(q.astype(jnp.bfloat16), jnp.zeros((1, 4, 8)))
    assert not native.indexer_scores_supported(jnp.zeros((1, 1, 65, 8)), jnp.zeros((1, 4, 8)))
    w, keys = jnp.ones((1, 1, 16)), jnp.ones((1, 4, 8), jnp.bfloat16)
    for platform in ("cuda", "tpu"):
        text = jax.jit(native.indexer_scores).trace(q, w, keys).lower(
            lowering_platforms=(platform,)).as_text()
        assert "jlco_indexer_scores" not in text





# ---- the library as a thing loaded into the engine: where it comes from --------------------


def _cached_build(monkeypatch, tmp_path):
    """A library built into a fresh cache under tmp_path → its path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = native._build()
    assert path.parent.stat().st_mode & 0o777 == 0o700      # the cache directory: private
    assert not path.stat().st_mode & 0o022
    return path


def test_a_planted_library_is_refused(monkeypatch, tmp_path):
    import os
    path = _cached_build(monkeypatch, tmp_path)
    path.chmod(0o775)                                       # group-writable: refused
    with pytest.raises(native.NativeUnavailable, match="refusing the library .*group- or world"):
        native._build()
    path.chmod(0o700)
    assert native._build() == path
    if os.getuid() == 0:                                    # another owner: refused
        os.chown(path, 4242, -1)
        with pytest.raises(native.NativeUnavailable, match="owned by uid 4242"):
            native._build()
        os.chown(path, 0, -1)
    path.parent.chmod(0o777)                                # the directory too
    with pytest.raises(native.NativeUnavailable, match="refusing the directory"):
        native._build()


def test_a_refused_library_falls_back_to_xla_with_a_warning(monkeypatch, tmp_path, caplog):
    path = _cached_build(monkeypatch, tmp_path)
    path.chmod(0o777)
    monkeypatch.setattr(native, "_load", native._load.__wrapped__)   # not the cached one
    native.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert native.available() is False
        assert "refusing the library" in caplog.text and "using XLA's ops" in caplog.text
        assert not runner.native_matmul("auto")              # the engine runs XLA's dot
    finally:
        native.available.cache_clear()


def test_a_cached_library_runs_no_compiler(monkeypatch, tmp_path):
    path = _cached_build(monkeypatch, tmp_path)

    def no_subprocess(*a, **k):
        raise AssertionError(f"a subprocess ran: {a}")
    monkeypatch.setattr(native.subprocess, "run", no_subprocess)
    assert native._build() == path


def test_a_compile_past_its_timeout_is_given_up(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 0.01)
    with pytest.raises(native.NativeUnavailable, match="took over 0.01 s"):
        native._build()
    assert not list(tmp_path.glob("jlco/native/*.so"))


def test_relu_keeps_nan_as_the_reference_does():
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 1, 16, 8)), jnp.float32)
    q = q.at[0, 0, 3, 2].set(jnp.nan)                      # head 3's logits are NaN
    w, keys = jnp.ones((1, 1, 16)), jnp.ones((1, 5, 8), jnp.float32)
    out = np.asarray(jax.jit(native.indexer_scores)(q, w, keys))
    ref = np.asarray(native.indexer_scores_ref(q, w, keys))
    assert np.isnan(ref).all() and np.isnan(out).all()


_UBSAN = """
import numpy as np, jax, jax.numpy as jnp
from jlco import native
native.FLAGS = native.FLAGS + ("-fsanitize=undefined", "-fno-sanitize-recover=all", "-g")
assert native.available()
rng = np.random.default_rng(0)
s = rng.standard_normal((3, 300)).astype(np.float32)
s[0, :8] = [np.nan, -np.nan, -np.inf, np.inf, -0.0, 0.0, -3e38, np.float32(-1e-45)]
s[1] = -np.abs(s[1])                                   # every order key from a negative float
for k in (1, 7, 300):
    got = jax.jit(native.top_k, static_argnums=1)(jnp.asarray(s), k)
    want = jax.lax.top_k(jnp.asarray(s), k)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
q = jnp.asarray(rng.standard_normal((2, 1, 16, 32)), jnp.float32).at[0, 0, 1, 1].set(jnp.nan)
native.indexer_scores(q, jnp.ones((2, 1, 16)), jnp.ones((2, 40, 32), jnp.bfloat16)).block_until_ready()
x, w = jnp.ones((2, 5, 64)), jnp.ones((2, 64, 33))
native.batched(x, w).block_until_ready()
print("ubsan-clean")
"""


@pytest.mark.slow   # a sanitizer build and a second interpreter: the slow tier (CI runs it)
def test_the_kernels_run_clean_under_ubsan(tmp_path):
    """kernels.cc built with -fsanitize=undefined (abort on the first report) runs the
    top-k over negative floats, NaN, -0.0 and infinities, the indexer's scores with a
    NaN and a matmul (a subprocess: its own cache, its own library)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _UBSAN], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "ubsan-clean" in r.stdout, (r.stdout + r.stderr)[-4000:]
