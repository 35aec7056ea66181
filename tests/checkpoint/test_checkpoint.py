"""HF safetensors loading (f32/bf16/f16/fp8 block-scaled, single/sharded, MTP), its error
messages, the safetensors reader/writer against the library, and the Orbax round trip.

Checkpoints are made by `transformers` itself (DeepseekV32ForCausalLM.save_pretrained) with
tiny dims; hidden 136 / FFN 264 make ragged 128×128 fp8 edge blocks.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import chex
import ml_dtypes
import numpy as np
import pytest

from jlco.checkpoint import safetensors_io as st
from jlco.checkpoint.load import (
    CheckpointError,
    expected_hf_tensors,
    load_hf_checkpoint,
    restore_orbax,
    save_orbax,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file as torch_load_file  # noqa: E402
from tests.support.checkpoint import fp8_tool

ROOT = pathlib.Path(__file__).resolve().parents[2]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
        "original_max_position_embeddings": 256, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0}
TINY = dict(vocab_size=512, hidden_size=136, intermediate_size=264, moe_intermediate_size=32,
            num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
            q_lora_rank=48, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, index_n_heads=16,
            index_head_dim=32, index_topk=32, max_position_embeddings=1024,
            rope_parameters=YARN)

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """single f32, sharded f32, bf16, fp8 + its f32 twin, all from one random model."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**TINY))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="300KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    fp8_tool().make_fp8_checkpoint(root / "sharded", root / "fp8", twin=root / "twin")
    (root / "single" / "tokenizer.json").write_text("{}")
    return root


def _lib_tensors(d: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint dir as f32, read by the safetensors library (torch)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in torch_load_file(str(f)).items()})
    return out


def _copy(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    """Copy an unsharded checkpoint, rewriting model.safetensors through `edit(tensors)`."""
    shutil.copytree(src, dst)
    t = {n: np.array(st.read_tensor(e)) for n, e in st.read_header(dst / st.SINGLE_FILE).items()}
    edit(t)
    st.write_safetensors(dst / st.SINGLE_FILE, t)
    return dst


def _mtp_tensors(cfg, rng) -> dict[str, np.ndarray]:
    full = expected_hf_tensors(cfg, mtp=True)
    base = expected_hf_tensors(cfg, mtp=False)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in full.items() if n not in base}


def test_single_file_matches_library_and_table(ckpts):
    ck = load_hf_checkpoint(ckpts / "single", progress=False)
    ref = _lib_tensors(ckpts / "single")
    assert set(ck.tensors) == set(ref) == set(expected_hf_tensors(ck.config, mtp=False))
    for n, t in ck.tensors.items():
        assert t.dtype == np.float32 and t.shape == ref[n].shape
        chex.assert_trees_all_equal({n: t}, {n: ref[n]})   # the key names the tensor
    assert not ck.has_mtp and ck.config.num_nextn_predict_layers == 0
    assert ck.tokenizer_path == ckpts / "single" / "tokenizer.json"
    assert ck.config.hidden_size == 136 and ck.config.rope_scaling.factor == 4.0
    assert ck.config.rope_scaling.original_max_position_embeddings == 256


def test_sharded_equals_single_and_bf16_output(ckpts):
    shards = sorted((ckpts / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 3
    single = load_hf_checkpoint(ckpts / "single", progress=False)
    sharded = load_hf_checkpoint(ckpts / "sharded", dtype=ml_dtypes.bfloat16, progress=False)
    assert set(sharded.tensors) == set(single.tensors)
    for n, t in sharded.tensors.items():
        assert t.dtype == ml_dtypes.bfloat16, n
        chex.assert_trees_all_equal({n: t}, {n: single.tensors[n].astype(ml_dtypes.bfloat16)})
    assert sharded.tokenizer_path is None


def test_bf16_and_f16_checkpoints_load_like_library(ckpts, tmp_path):
    ck = load_hf_checkpoint(ckpts / "bf16", progress=False)
    ref = _lib_tensors(ckpts / "bf16")
    for n, t in ck.tensors.items():   # chex takes no err_msg: the dict key names the tensor
        chex.assert_trees_all_equal({n: t}, {n: ref[n]})
    raw = st.read_header(ckpts / "bf16" / st.SINGLE_FILE)
    assert {e.dtype for n, e in raw.items() if "weights_proj" not in n} == {"BF16"}
    d = _copy(ckpts / "single", tmp_path / "f16",
              lambda t: t.update({n: a.astype(np.float16) for n, a in t.items()}))
    f16 = load_hf_checkpoint(d, progress=False)
    for n, t in _lib_tensors(d).items():
        chex.assert_trees_all_equal({n: f16.tensors[n]}, {n: t})


def test_progress_goes_to_stderr_on_a_terminal_only(ckpts, capsys, monkeypatch):
    """The bar goes to stderr when it is a terminal; a redirected log gets none, and
    progress=False silences it everywhere."""
    load_hf_checkpoint(ckpts / "sharded", progress=True)
    assert capsys.readouterr() == ("", "")          # captured stderr: not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load_hf_checkpoint(ckpts / "sharded", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "loading HF tensors" in err and "model-000" in err
    load_hf_checkpoint(ckpts / "sharded", progress=False)
    assert capsys.readouterr() == ("", "")


def test_writer_reader_interop_with_library(tmp_path):
    rng = np.random.default_rng(1)
    src = {"a": rng.standard_normal((3, 5)).astype(np.float32),
           "b": rng.standard_normal((130,)).astype(ml_dtypes.bfloat16),
           "c": rng.standard_normal((2, 2, 3)).astype(np.float16),
           "d": rng.standard_normal((7, 9)).astype(ml_dtypes.float8_e4m3fn)}
    st.write_safetensors(tmp_path / "x.safetensors", src)
    lib = torch_load_file(str(tmp_path / "x.safetensors"))
    assert str(lib["d"].dtype) == "torch.float8_e4m3fn" and str(lib["b"].dtype) == "torch.bfloat16"
    ours = st.read_header(tmp_path / "x.safetensors")
    for n, a in src.items():
        chex.assert_trees_all_equal({n: lib[n].float().numpy()}, {n: a.astype(np.float32)})
        chex.assert_trees_all_equal({n: np.asarray(st.read_tensor(ours[n]))}, {n: a})


def test_fp8_equals_twin_exactly_and_matches_library_dequant(ckpts):
    fp8 = load_hf_checkpoint(ckpts / "fp8", progress=False)
    twin = load_hf_checkpoint(ckpts / "twin", progress=False)
    orig = load_hf_checkpoint(ckpts / "single", progress=False)
    raw = st.index_checkpoint(ckpts / "fp8")
    quantized = [n for n, e in raw.items() if e.dtype == "F8_E4M3"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in quantized
    assert raw["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)  # 264×136
    assert set(fp8.tensors) == set(twin.tensors) == set(orig.tensors)
    lib = _lib_tensors(ckpts / "fp8")
    for n, t in fp8.tensors.items():
        chex.assert_trees_all_equal({n: t}, {n: twin.tensors[n]})   # the key names the tensor
        if n in quantized:  # independent dequant: library-read e4m3 × expanded block scale
            s = np.kron(lib[n + "_scale_inv"], np.ones((128, 128), np.float32))
            chex.assert_trees_all_equal({n: t}, {n: lib[n] * s[: t.shape[0], : t.shape[1]]})
            amax = np.abs(orig.tensors[n]).max()
            assert np.abs(t - orig.tensors[n]).max() <= amax / 8, n  # e4m3: 3 mantissa bits
        else:
            chex.assert_trees_all_equal({n: t}, {n: orig.tensors[n]})


def test_dequantize_ragged_blocks():
    w = np.ones((130, 260), ml_dtypes.float8_e4m3fn)
    s = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    d = st.dequantize_fp8_blocks(w, s)
    assert d[0, 0] == 1 and d[127, 128] == 2 and d[128, 0] == 4 and d[129, 259] == 6
    q, sc = st.quantize_fp8_blocks(np.where(np.arange(260) < 256, 1.0, 8.0)[None].repeat(130, 0))
    assert sc.shape == (2, 3) and sc[0, 2] == 8 / 448 and sc[1, 0] == 1 / 448
    tail = st.dequantize_fp8_blocks(q, sc)[:, 256:]
    chex.assert_trees_all_equal(tail, np.full_like(tail, 8.0))


def test_mtp_layer_detected_and_loaded(ckpts, tmp_path):
    cfg = load_hf_checkpoint(ckpts / "single", progress=False).config
    extra = _mtp_tensors(cfg, np.random.default_rng(2))
    assert "model.layers.3.eh_proj.weight" in extra
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in extra
    copy = {"model.layers.3.embed_tokens.weight": np.ones((512, 136), np.float32)}  # ignored
    d = _copy(ckpts / "single", tmp_path / "mtp", lambda t: t.update(extra | copy))
    ck = load_hf_checkpoint(d, progress=False)
    assert ck.has_mtp and set(ck.tensors) == set(expected_hf_tensors(cfg, mtp=True))
    assert ck.config.num_nextn_predict_layers == 1
    assert "model.layers.3.embed_tokens.weight" not in ck.tensors
    for n, a in extra.items():
        chex.assert_trees_all_equal({n: ck.tensors[n]}, {n: a})   # the key names the tensor
    d2 = _copy(d, tmp_path / "mtp_partial", lambda t: t.pop("model.layers.3.hnorm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.3\.hnorm\.weight'"):
        load_hf_checkpoint(d2, progress=False)
    d3 = _copy(ckpts / "single", tmp_path / "no_mtp_copy",
               lambda t: t.update({"model.layers.2.embed_tokens.weight": copy[
                   "model.layers.3.embed_tokens.weight"]}))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.2\.embed_tokens"):
        load_hf_checkpoint(d3, progress=False)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize("case,edit,pattern", [
    ("missing", lambda t: t.pop("model.layers.2.self_attn.kv_b_proj.weight"),
     r"missing tensor 'model\.layers\.2\.self_attn\.kv_b_proj\.weight'"),
    ("unknown", _set("model.layers.0.self_attn.extra.weight", np.zeros(3, np.float32)),
     r"unknown tensor 'model\.layers\.0\.self_attn\.extra\.weight' \(model\.safetensors\)"),
    ("shape", _set("model.layers.1.mlp.gate.weight", np.zeros((8, 135), np.float32)),
     r"'model\.layers\.1\.mlp\.gate\.weight' \(model\.safetensors\) has shape \[8, 135\], "
     r"expected \[8, 136\]"),
    ("dtype", _set("model.norm.weight", np.zeros(136, np.int64)),
     r"'model\.norm\.weight' \(model\.safetensors\) has unsupported dtype I64"),
    ("fp8_no_scale", _set("model.layers.0.mlp.up_proj.weight",
                          np.zeros((264, 136), ml_dtypes.float8_e4m3fn)),
     r"fp8 tensor 'model\.layers\.0\.mlp\.up_proj\.weight' .* no scale tensor"),
    ("orphan_scale", _set("model.layers.0.mlp.up_proj.weight_scale_inv",
                          np.ones((3, 2), np.float32)),
     r"scale tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale_inv' .* no fp8"),
])
def test_bad_tensor_errors_name_the_tensor(ckpts, tmp_path, case, edit, pattern):
    d = _copy(ckpts / "single", tmp_path / case, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf_checkpoint(d, progress=False)


def test_fp8_scale_with_wrong_shape(ckpts, tmp_path):
    d = tmp_path / "fp8bad"
    shutil.copytree(ckpts / "fp8", d)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    shard = json.loads((d / st.INDEX_FILE).read_text())["weight_map"][name]
    t = {n: np.array(st.read_tensor(e)) for n, e in st.read_header(d / shard).items()}
    t[name] = np.ones((2, 2), np.float32)  # o_proj is 136×128 → [2, 1]
    st.write_safetensors(d / shard, t)
    with pytest.raises(CheckpointError, match=rf"scale tensor '{name}' \({shard}\) has shape "
                                              r"\[2, 2\], expected \[2, 1\]"):
        load_hf_checkpoint(d, progress=False)


def test_sharded_index_errors(ckpts, tmp_path):
    d = tmp_path / "noshard"
    shutil.copytree(ckpts / "sharded", d)
    gone = sorted(d.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file\(s\) \['{gone.name}'\]"):
        load_hf_checkpoint(d, progress=False)
    d2 = tmp_path / "badindex"
    shutil.copytree(ckpts / "sharded", d2)
    idx = json.loads((d2 / st.INDEX_FILE).read_text())
    idx["weight_map"]["model.layers.0.ghost.weight"] = "model-00001-of-" + \
        idx["weight_map"]["model.norm.weight"].split("-of-")[1]
    (d2 / st.INDEX_FILE).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.ghost\.weight' is listed"):
        load_hf_checkpoint(d2, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_checkpoint(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path, progress=False)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_hf_checkpoint(tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="dtype="):
        load_hf_checkpoint(tmp_path, dtype=np.float16)


# ----------------------------------------------------------------------------- Orbax


def _tiny_cfg():
    from jlco.config import load_config
    return load_config(ROOT / "configs/tiny.py").model


def _state_like_model(dtype_a="bfloat16", rows=5):
    """An nnx state shaped like the model's: nested modules, an nnx.List of layers, bf16
    and f32 leaves (stand-in where the real model is not needed)."""
    import jax.numpy as jnp
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(4, 6, rngs=rngs)
            self.norm = nnx.Param(jnp.linspace(0.5, 1.5, 6, dtype=jnp.float32))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(rows, 4, param_dtype=getattr(jnp, dtype_a), rngs=rngs)
            self.layers = nnx.List([Layer(rngs) for _ in range(2)])

    return nnx.eval_shape(lambda: Model(nnx.Rngs(0))), Model(nnx.Rngs(3))


def _assert_same_leaves(a, b):
    import jax
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        chex.assert_trees_all_equal(np.asarray(x), np.asarray(y))


def test_orbax_round_trip_exact(tmp_path):
    from flax import nnx
    cfg = _tiny_cfg()
    abstract, model = _state_like_model()
    state = nnx.state(model)
    save_orbax(tmp_path / "o", cfg, state)
    got_cfg, got = restore_orbax(tmp_path / "o", nnx.state(abstract))
    assert got_cfg == cfg and isinstance(got, nnx.State)
    assert got["embed"]["embedding"][...].dtype == ml_dtypes.bfloat16
    _assert_same_leaves(got, state)
    pure = nnx.to_pure_dict(state)
    save_orbax(tmp_path / "p", cfg, pure)
    _, got_pure = restore_orbax(tmp_path / "p", nnx.to_pure_dict(nnx.state(abstract)))
    _assert_same_leaves(got_pure, pure)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_orbax(tmp_path / "o", cfg, state)


def test_orbax_restore_enforces_dtype_and_shape(tmp_path):
    from flax import nnx
    _, model = _state_like_model()
    save_orbax(tmp_path / "o", _tiny_cfg(), nnx.state(model))
    f32_abstract, _ = _state_like_model(dtype_a="float32")
    with pytest.raises(CheckpointError, match=r"leaf 'embed/embedding': checkpoint "
                                              r"bfloat16\[5, 4\], model float32\[5, 4\]"):
        restore_orbax(tmp_path / "o", nnx.state(f32_abstract))
    bigger, _ = _state_like_model(rows=7)
    with pytest.raises(CheckpointError, match=r"leaf 'embed/embedding'.*model bfloat16\[7, 4\]"):
        restore_orbax(tmp_path / "o", nnx.state(bigger))
    with pytest.raises(CheckpointError, match="jlco_checkpoint.json"):
        restore_orbax(tmp_path)


def test_real_model_hf_to_orbax_round_trip(ckpts, tmp_path):
    """HF dir → model (jlco.checkpoint.hf_names) → Orbax → restored into the model's abstract state:
    every leaf equal with its dtype; load_model gives the same model from both kinds."""
    import jax
    from flax import nnx

    from jlco.checkpoint.load import checkpoint_kind, load_model
    cfg, model, info = load_model(ckpts / "single", {"dtype": "float32"}, progress=False)
    assert info["kind"] == "hf" and not info["has_mtp"] and model.mtp is None
    ref = load_hf_checkpoint(ckpts / "single", progress=False).tensors
    chex.assert_trees_all_equal(np.asarray(model.embed_tokens[...]),
                                ref["model.embed_tokens.weight"])
    state = nnx.state(model)
    save_orbax(tmp_path / "o", cfg, state)
    assert checkpoint_kind(tmp_path / "o") == "orbax"
    got_cfg, got = restore_orbax(tmp_path / "o")
    assert got_cfg == cfg
    _assert_same_leaves(got, state)
    assert {x.dtype for x in jax.tree.leaves(got)} == {np.dtype(np.float32)}
    cfg2, model2, info2 = load_model(tmp_path / "o")
    assert info2["kind"] == "orbax" and cfg2 == cfg
    _assert_same_leaves(nnx.state(model2), state)
    with pytest.raises(CheckpointError, match=r"leaf 'embed_tokens': checkpoint float32\[512, "
                                              r"136\], model bfloat16\[512, 136\]"):
        load_model(tmp_path / "o", {"dtype": "bfloat16"})
    with pytest.raises(CheckpointError, match="neither a jlco Orbax dir"):
        load_model(tmp_path)


@pytest.mark.e2e
def test_convert_cli_fp8_with_mtp(ckpts, tmp_path):
    """`python -m jlco.convert` on an fp8 checkpoint with an MTP layer → bf16 Orbax whose
    weights are the dequantised twin's, rounded to bf16 once."""
    import subprocess
    import sys

    from flax import nnx

    from jlco.checkpoint.load import load_model
    cfg = load_hf_checkpoint(ckpts / "single", progress=False).config
    extra = _mtp_tensors(cfg, np.random.default_rng(4))
    src = _copy(ckpts / "single", tmp_path / "mtp", lambda t: t.update(extra))
    fp8_tool().make_fp8_checkpoint(src, tmp_path / "fp8", twin=tmp_path / "twin")
    out = tmp_path / "orbax"
    r = subprocess.run([sys.executable, "-m", "jlco.convert", "--checkpoint",
                        str(tmp_path / "fp8"), "--output", str(out), "--dtype", "bfloat16",
                        "--noprogress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["mtp"] and summary["dtype"] == "bfloat16" and "MTP: yes" in r.stdout
    assert summary["hf_tensors"] == len(expected_hf_tensors(cfg, mtp=True))
    cfg_o, model, info = load_model(out)
    assert cfg_o.dtype == "bfloat16" and cfg_o.num_nextn_predict_layers == 1 and info["has_mtp"]
    twin = load_hf_checkpoint(tmp_path / "twin", dtype=ml_dtypes.bfloat16, progress=False)
    _, from_twin, _ = load_model(tmp_path / "twin", progress=False)
    _assert_same_leaves(nnx.state(model), nnx.state(from_twin))
    chex.assert_trees_all_equal(np.asarray(model.mtp.eh_proj.weight[...]),
                                twin.tensors["model.layers.3.eh_proj.weight"].T)
    from jlco.convert import convert
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        convert(str(tmp_path / "fp8"), str(out))
