"""Shared by the checkpoint tests: tools/make_fp8_checkpoint.py loaded as a module (tools/
is not a package), to turn a transformers checkpoint into its fp8 block-scaled twin."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fp8_tool():
    spec = importlib.util.spec_from_file_location("make_fp8", ROOT / "tools/make_fp8_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
