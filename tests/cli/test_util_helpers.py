"""jlco.util: atomic writes (old or new content, never half; umask permissions; nothing
left behind on failure), the output-path check, one-line error exits, strict report
JSON, and where the persistent compilation cache lives (and that enable() configures
an already-imported jax)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from tests.support.cli import run

from jlco.util import atomic, cli, compile_cache


def test_write_text_is_atomic_with_normal_permissions(tmp_path):
    p = tmp_path / "sub" / "report.json"
    atomic.write_text(p, "old")
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    assert p.read_text() == "old"
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~old_umask
    with pytest.raises(TypeError):
        atomic.write_bytes(p, "not bytes")   # fails mid-write: the old file stays whole
    assert p.read_text() == "old" and sorted(x.name for x in p.parent.iterdir()) == ["report.json"]
    with pytest.raises(RuntimeError):
        with atomic.temp_sibling(p, suffix=".py") as tmp:
            assert tmp.name.endswith(".py") and tmp.parent == p.parent
            tmp.write_text("new")
            raise RuntimeError("reader said no")
    assert p.read_text() == "old" and len(list(p.parent.iterdir())) == 1


def test_new_directory_renames_only_when_complete(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic.new_directory(target) as tmp:
            (tmp / "part").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic.new_directory(target) as tmp:
        (tmp / "done").write_text("x")
    assert (target / "done").is_file() and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(OSError):   # never replaces a non-empty directory
        with atomic.new_directory(target) as tmp:
            (tmp / "other").write_text("y")
    assert sorted(x.name for x in target.iterdir()) == ["done"]
    assert len(list(tmp_path.iterdir())) == 1


def test_check_writable_names_the_culprit(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    assert atomic.check_writable(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    with pytest.raises(NotADirectoryError, match=r"--out .*'.*afile' is not a directory"):
        atomic.check_writable(tmp_path / "afile" / "x", "--out")
    monkeypatch.setattr(os, "access", lambda *_a: False)   # as root, every dir is writable
    with pytest.raises(PermissionError, match=rf"directory '{tmp_path}' is not writable"):
        atomic.check_writable(tmp_path / "new", "output")


def test_errors_exit_is_one_line(capsys):
    with pytest.raises(SystemExit) as ex:
        with cli.errors_exit("prog", ValueError):
            raise ValueError("--flag=3 is invalid: allowed 1..2")
    assert ex.value.code == 2
    assert capsys.readouterr().err == "prog: error: --flag=3 is invalid: allowed 1..2\n"
    with pytest.raises(KeyError):   # unlisted types are bugs: they keep their traceback
        with cli.errors_exit("prog", ValueError):
            raise KeyError("x")
    assert json.loads(cli.report_json({"a": [float("nan"), 1.5], "b": float("inf")})) == \
        {"a": [None, 1.5], "b": None}


def test_compile_cache_location(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == tmp_path / "xdg" / "jlco" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.cache_dir() == tmp_path / "home" / ".cache" / "jlco" / "jax"
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "mine"))
    assert compile_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv(compile_cache.ENV_VAR, "")
    assert compile_cache.cache_dir() is None


def test_enable_configures_an_imported_jax(tmp_path):
    """In a child process (enable() sets process-wide state): jax imported first, then
    enable(); then the same with the cache disabled by an empty variable."""
    code = ("import jax; from jlco.util import compile_cache as c; p = c.enable(); "
            "print(p, jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir, "
            "jax.config.jax_persistent_cache_min_compile_time_secs)")
    on = run("-c", code, env={compile_cache.ENV_VAR: str(tmp_path / "c")})
    assert on.returncode == 0, on.stderr
    assert on.stdout.split() == [str(tmp_path / "c"), "True", str(tmp_path / "c"), "0.0"]
    assert (tmp_path / "c").is_dir()
    off = run("-c", code, env={compile_cache.ENV_VAR: ""})
    assert off.returncode == 0 and off.stdout.split()[:2] == ["None", "False"], off.stderr
