"""`jlco.native` where its kernels cannot run: a missing compiler named, `$JLCO_NATIVE=0`,
`engine.cpu_matmul` refusing "native" without them and the engine on XLA's ops. These
run on every CPU machine, with or without a C++ compiler (tests/native/test_native.py
needs one)."""

import jax
import pytest

from jlco import native
from jlco.config import load_config
from jlco.engine import runner

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="XLA:CPU kernels: the default backend here is not CPU")


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(native.NativeUnavailable, match="no C..? compiler: 'no-such-c"):
        native._build()


def test_cpu_matmul_without_the_kernels(monkeypatch):
    assert runner.native_matmul("xla") is False

    def unavailable():
        raise native.NativeUnavailable("no C++ compiler: 'c++' is not on PATH (set $CXX)")

    monkeypatch.setattr(native, "load", unavailable)
    with pytest.raises(ValueError, match="engine.cpu_matmul='native': no C.. compiler"):
        runner.native_matmul("native")
    cfg = load_config("configs/tiny.py")
    with pytest.raises(ValueError, match="engine.cpu_matmul"):
        cfg.replace(engine__cpu_matmul="fast")


def test_jlco_native_0_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    with pytest.raises(native.NativeUnavailable, match=r"turned off by \$JLCO_NATIVE=0"):
        native.load()
