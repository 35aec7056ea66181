"""Helpers for the CLI tests: run an entry point as a user would (a subprocess), check
that a bad input ends in one clear error line (exit code, no traceback, the culprit
named), and build the tiny float32 Hugging Face checkpoint (transformers' own
save_pretrained) that several tests decode."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MPE = 256   # the checkpoint's max_position_embeddings: below configs/tiny.py's context 512


def run(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python ARGS...` from the repository root; `env` entries are added to os.environ."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_error(r: subprocess.CompletedProcess, codes, *needles: str) -> str:
    """The run failed with one of `codes`, printed no traceback, and its stderr names
    every needle. Returns stderr."""
    codes = (codes,) if isinstance(codes, int) else tuple(codes)
    assert r.returncode in codes, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in r.stderr, (n, r.stderr[-3000:])
    return r.stderr


def tiny_model_config(**changes):
    """configs/tiny.py's model with max_position_embeddings MPE (and `changes`)."""
    from jlco.config import load_config
    return dataclasses.replace(load_config(ROOT / "configs" / "tiny.py").model,
                               max_position_embeddings=MPE, **changes)


def make_hf_checkpoint(path: pathlib.Path, **changes):
    """A float32 DeepseekV32 checkpoint written by transformers at `path`; returns the
    transformers model (the reference). Larger init than transformers' default so greedy
    tokens are decisive (tests/support/hf_reference.py)."""
    from tests.support.hf_reference import build_hf_model
    ref = build_hf_model(tiny_model_config(**changes), seed=0, init_std=0.1, bias_std=0.05)
    ref.save_pretrained(path)
    return ref
