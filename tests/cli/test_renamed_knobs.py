"""Renamed knobs (jlco.config.RENAMED): cache.staging_capacity is now
cache.hot_buffer_rows and cache.prefetch_window is now cache.fetch_chunk_rows. For one
release the old spellings still work wherever users wrote them (CacheConfig keywords in
config files, Config.replace, --override, tools/tune.py flags), give the same Config,
and say once, naming the new spelling, that they are deprecated; --help and the docs
show only the new names."""

from __future__ import annotations

import pathlib
import warnings

import pytest
from tests.support.cli import ROOT, run

from jlco.config import (
    RENAMED,
    CacheConfig,
    Config,
    RenamedKnobWarning,
    apply_overrides,
    load_config,
)

NEW = CacheConfig(offload=True, hot_buffer_rows=4096, fetch_chunk_rows=8)


def _deprecations(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RenamedKnobWarning)]


def test_old_keywords_build_the_same_cache_config():
    with pytest.warns(RenamedKnobWarning) as record:
        old = CacheConfig(offload=True, staging_capacity=4096, prefetch_window=8)
    assert old == NEW
    msgs = _deprecations(record)
    assert len(msgs) == 2
    assert "cache.staging_capacity" in msgs[0] and "cache.hot_buffer_rows" in msgs[0]
    assert "cache.prefetch_window" in msgs[1] and "cache.fetch_chunk_rows" in msgs[1]


def test_new_keywords_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CacheConfig(offload=True, hot_buffer_rows=4096, fetch_chunk_rows=8) == NEW


def test_old_and_new_spelling_together_is_an_error():
    with pytest.warns(RenamedKnobWarning), pytest.raises(TypeError, match="same knob"):
        CacheConfig(staging_capacity=4096, hot_buffer_rows=4096)


def test_replace_and_override_accept_the_old_spelling_once():
    base = Config(cache=CacheConfig(offload=True))
    want = base.replace(cache__hot_buffer_rows=4096, cache__fetch_chunk_rows=8)
    with pytest.warns(RenamedKnobWarning) as record:
        got = base.replace(cache__staging_capacity=4096, cache__prefetch_window=8)
    assert got == want and len(_deprecations(record)) == 2
    with pytest.warns(RenamedKnobWarning) as record:
        got = apply_overrides(base, ["cache.staging_capacity=4096", "cache.prefetch_window=8"])
    assert got == want and len(_deprecations(record)) == 2


def test_config_file_with_the_old_spelling_loads(tmp_path):
    f = tmp_path / "old.py"
    f.write_text("from jlco.config import CacheConfig, Config\n"
                 "CONFIG = Config(cache=CacheConfig(offload=True, staging_capacity=4096,\n"
                 "                                  prefetch_window=8))\n")
    with pytest.warns(RenamedKnobWarning) as record:
        assert load_config(f).cache == NEW
    assert len(_deprecations(record)) == 2


@pytest.mark.e2e
def test_cli_override_prints_the_deprecation_once():
    """--override with an old name: one deprecation line on stderr naming the new one
    (then a bad value elsewhere ends the run before any model is built)."""
    r = run("-m", "jlco.serve", "--config=configs/tiny.py",
            "--override=cache.prefetch_window=16", "--override=engine.max_batch_size=0")
    assert r.returncode != 0 and "engine.max_batch_size" in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "is deprecated" in ln]
    assert len(lines) == 1 and "cache.fetch_chunk_rows" in lines[0], r.stderr[-2000:]


@pytest.mark.e2e
def test_tune_flags_new_names_in_help_old_names_accepted():
    r = run("tools/tune.py", "--help")        # absl's --help exits 1
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--hot_buffer_rows" in r.stdout and "--fetch_chunk_rows" in r.stdout
    r = run("tools/tune.py", "--config=configs/tiny.py", "--staging_capacity=big")
    assert r.returncode != 0 and "hot_buffer_rows='big'" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("doc", ["README.md", "tools/monitoring/README.md",
                                 "jlco/ops/diagnose.py"])
def test_docs_name_the_new_knobs(doc):
    """Docs name the knobs by their new names (README also lists the old spellings
    once, as still accepted)."""
    text = (pathlib.Path(ROOT) / doc).read_text()
    assert "cache.hot_buffer_rows" in text
    for old in RENAMED["cache"]:
        assert f"cache.{old}" not in text
