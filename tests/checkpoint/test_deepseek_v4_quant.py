"""DeepSeek-V4's fp8 / fp4 block formats against transformers' own dequantiser
(`Fp8Dequantize._dequantize_one`, the independent reference): e4m3 weights with e8m0
(or f32) block scales, packed e2m1 (two per int8 byte) with 1 × n scales, and a whole
tiny V4 checkpoint quantised that way loading to exactly the weights transformers'
dequantiser gives."""

import json

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from jlco.checkpoint import deepseek_v4_quant as quant
from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.deepseek_v4 import load_v4
from jlco.checkpoint.hf_reference import build_hf_v4_model
from jlco.checkpoint.safetensors_io import CheckpointError

REF = Fp8Dequantize(None)


def _fp8(shape, gen):
    return (torch.randn(shape, generator=gen) * 40).to(torch.float8_e4m3fn)


def _e8m0(shape, gen):
    return torch.randint(120, 134, shape, generator=gen, dtype=torch.uint8).view(
        torch.float8_e8m0fnu)


def _fp4(shape, gen):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


def _entries(tmp_path, tensors):
    save_file(tensors, tmp_path / "q.safetensors")
    return st.read_header(tmp_path / "q.safetensors")


@pytest.mark.parametrize("kind", ["fp8_e8m0", "fp8_f32", "fp4_e8m0"])
def test_dequantize_matches_transformers(kind, tmp_path):
    gen = torch.Generator().manual_seed(0)
    if kind.startswith("fp8"):
        w = _fp8((64, 48), gen)
        s = _e8m0((4, 3), gen) if kind == "fp8_e8m0" else torch.rand((4, 3), generator=gen)
    else:
        w, s = _fp4((16, 32), gen), _e8m0((16, 2), gen)
    want = REF._dequantize_one(w, s, torch.float32).numpy()
    e = _entries(tmp_path, {"x.weight": w, "x.scale": s})
    got = quant.read_dequantized(e["x.weight"], e["x.scale"])
    np.testing.assert_array_equal(got, want)


def test_unpaired_and_ragged_are_refused(tmp_path):
    gen = torch.Generator().manual_seed(1)
    e = _entries(tmp_path, {"x.weight": _fp8((16, 16), gen)})
    with pytest.raises(CheckpointError, match="'x.weight'.*no scale tensor"):
        quant.pair_scales(e)
    e = _entries(tmp_path, {"x.weight": _fp8((16, 16), gen), "x.scale": _e8m0((3, 1), gen)})
    with pytest.raises(CheckpointError, match="not a whole number of blocks"):
        quant.read_dequantized(e["x.weight"], e["x.scale"])


def _quantise(name: str, t: torch.Tensor, gen) -> dict:
    """fp8 (8 × 8 blocks) for attention / shared-expert linears, fp4 (1 × 8) for routed
    experts: random codes and scales (the values only need to be what the reference
    dequantises, not close to t)."""
    base = name.removesuffix(".weight")
    if ".experts." in name:
        rows, cols = t.shape
        return {name: _fp4((rows, cols // 2), gen), base + ".scale": _e8m0((rows, cols // 8), gen)}
    rows, cols = t.shape
    return {name: _fp8(t.shape, gen), base + ".scale": _e8m0((rows // 8, cols // 8), gen)}


def test_quantised_checkpoint_loads_as_transformers_dequantises(tmp_path):
    model = build_hf_v4_model()
    ref_dir, q_dir, f_dir = (tmp_path / n for n in ("ref", "q", "f"))
    model.save_pretrained(ref_dir)
    tensors = load_file(ref_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    quantised, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.ndim == 2 and (
                ".attn.w" in name or "shared_experts" in name or ".experts." in name):
            q = _quantise(name, t, gen)
            quantised |= q
            plain[name] = REF._dequantize_one(q[name], q[name[:-7] + ".scale"], torch.float32)
        else:
            quantised[name] = plain[name] = t
    cfg = json.loads((ref_dir / "config.json").read_text())
    cfg |= {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "weight_block_size": [128, 128]}, "expert_dtype": "fp4"}
    for d, ts in ((q_dir, quantised), (f_dir, plain)):
        d.mkdir()
        save_file(ts, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(cfg))
    _, got = load_v4(q_dir, dtype="float32")
    _, want = load_v4(f_dir, dtype="float32")
    got_leaves = dict(nnx.to_flat_state(nnx.state(got)))
    for path, var in nnx.to_flat_state(nnx.state(want)):
        np.testing.assert_array_equal(np.asarray(got_leaves[path].get_value()),
                                      np.asarray(var.get_value()), err_msg=str(path))
