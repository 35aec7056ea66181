"""Streaming, sharded HF loading (jlco.checkpoint.stream): the same bits as reading whole
tensors (f32 / bf16 / f16 models; f32, bf16 and fp8 block-scaled sources; MTP), host
memory bounded by one shard file beyond the model (peak RSS measured in a subprocess),
and each of 4 devices holding exactly its slice when the experts axis is split 4 ways.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import chex
import numpy as np
import pytest
from tests.support.checkpoint import fp8_tool

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# hidden 136 / FFN 264 make ragged fp8 edge blocks, so 4-way slices cut through blocks.
SMALL = dict(vocab_size=256, hidden_size=136, intermediate_size=264, moe_intermediate_size=32,
             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
             q_lora_rank=48, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
             v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
             n_group=4, topk_group=2, index_n_heads=4, index_head_dim=32, index_topk=8,
             max_position_embeddings=128)
# ≈ 200 MB of f32 weights, mostly routed experts, saved in ≈ 40 MB shards.
WIDE = dict(SMALL, hidden_size=512, moe_intermediate_size=256, n_routed_experts=64,
            num_hidden_layers=3)
SHARD = "40MB"

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**SMALL))
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    fp8_tool().make_fp8_checkpoint(root / "sharded", root / "fp8", twin=root / "twin")
    return root


def _whole(path, dtype):
    """The pre-streaming path: every tensor in host memory, then the model."""
    from jlco.checkpoint.hf_names import model_from_hf
    from jlco.checkpoint.load import load_dtype, load_hf_checkpoint
    ck = load_hf_checkpoint(path, dtype=load_dtype(dtype), progress=False,
                            cfg_overrides={"dtype": dtype})
    return model_from_hf(ck.config, ck.tensors, mtp=ck.has_mtp)


@pytest.mark.parametrize("src,dtype", [("sharded", "float32"), ("sharded", "float16"),
                                       ("bf16", "bfloat16"), ("fp8", "bfloat16"),
                                       ("fp8", "float32")])
def test_streaming_equals_whole_tensor_load(small, src, dtype):
    from flax import nnx

    from jlco.checkpoint.load import load_model
    _, model, info = load_model(small / src, {"dtype": dtype}, progress=False)
    want = nnx.to_flat_state(nnx.state(_whole(small / src, dtype)))
    got = dict(nnx.to_flat_state(nnx.state(model)))
    assert info["tensors"] > 0 and len(got) == len(want)
    for path, var in want:
        a, b = np.asarray(got[path].get_value()), np.asarray(var.get_value())
        assert a.dtype == b.dtype, path   # (weights_proj stays f32 in every model)
        chex.assert_trees_all_equal({"/".join(map(str, path)): a},
                                    {"/".join(map(str, path)): b})


def test_streaming_names_non_finite_weight(small, tmp_path):
    import shutil

    from jlco.checkpoint import safetensors_io as st
    from jlco.checkpoint.load import CheckpointError, load_model
    d = tmp_path / "nan"
    shutil.copytree(small / "sharded", d)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    shard = json.loads((d / st.INDEX_FILE).read_text())["weight_map"][name]
    t = {n: np.array(st.read_tensor(e)) for n, e in st.read_header(d / shard).items()}
    t[name][7, 3] = np.inf
    st.write_safetensors(d / shard, t)
    with pytest.raises(CheckpointError, match=rf"'{name}' \({shard}\) has 1 non-finite "
                                              r"value\(s\) .* index \[7, 3\]"):
        load_model(d, {"dtype": "float32"}, progress=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A ≈200 MB f32 checkpoint in ≈40 MB shards (transformers' save_pretrained)."""
    root = tmp_path_factory.mktemp("wide")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**WIDE))
    model.save_pretrained(root, max_shard_size=SHARD)
    del model
    assert len(list(root.glob("model-*.safetensors"))) >= 4
    return root


def _run(script: str, *args: str, env: dict | None = None) -> dict:
    import os
    full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], check=False,
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=full_env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


MEASURE = """
    import json, sys
    import jax, flax.nnx, numpy as np
    import jlco.checkpoint.load as L
    from jlco.checkpoint.hf_names import model_from_hf

    def status(key):   # kB lines of /proc/self/status
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    jax.devices()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")    # VmHWM := VmRSS: the peak from here on, imports excluded
    base = status("VmRSS")
    if sys.argv[2] == "convert":     # model + save; the Orbax side holds <= argv[4] bytes
        from jlco.convert import convert
        s = convert(sys.argv[1], sys.argv[3], "float32", False, int(sys.argv[4]))
        print(json.dumps({"extra": status("VmHWM") - base, "base": base, "model": s["bytes"]}))
        sys.exit(0)
    if sys.argv[2] == "stream":
        _, model, _ = L.load_model(sys.argv[1], {"dtype": "float32"}, progress=False)
    else:
        ck = L.load_hf_checkpoint(sys.argv[1], progress=False, cfg_overrides={"dtype": "float32"})
        model = model_from_hf(ck.config, ck.tensors, mtp=ck.has_mtp)
    leaves = jax.tree.leaves(flax.nnx.state(model))
    jax.block_until_ready(leaves)
    print(json.dumps({"extra": status("VmHWM") - base, "base": base,
                      "model": sum(x.nbytes for x in leaves)}))
"""
# Peak RSS is VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork+exec,
# so a subprocess of this (large) pytest process would start with the parent's peak.


def test_streaming_peak_rss_is_model_plus_one_shard(wide):
    """Peak RSS beyond the imports < the model (one device holds all of it) + 1.5 × the
    largest shard file; the whole-tensor path holds the model about twice over."""
    largest = max(f.stat().st_size for f in wide.glob("model-*.safetensors"))
    got = _run(MEASURE, str(wide), "stream")
    budget = got["model"] + 1.5 * largest
    print(f"streaming: extra {got['extra'] / 2**20:.1f} MiB, model {got['model'] / 2**20:.1f}"
          f" MiB, largest shard {largest / 2**20:.1f} MiB")
    assert got["extra"] < budget, (got, largest)


def test_convert_peak_rss_is_model_plus_one_shard_plus_inflight(wide, tmp_path):
    """`jlco.convert` streams the same way; Orbax then holds at most `inflight` bytes
    beyond the model (as its host copy and as tensorstore's write buffer, plus slack)."""
    largest = max(f.stat().st_size for f in wide.glob("model-*.safetensors"))
    inflight = 40 << 20                    # ≥ the largest leaf (32 MiB of experts)
    got = _run(MEASURE, str(wide), "convert", str(tmp_path / "o"), str(inflight))
    print(f"convert: extra {got['extra'] / 2**20:.1f} MiB, model {got['model'] / 2**20:.1f} MiB")
    assert (tmp_path / "o" / "jlco_checkpoint.json").is_file()
    # measured 250-310 MiB here (async writes vary); unbounded Orbax: ≈400; whole: ≈600
    assert got["extra"] < got["model"] + 1.5 * largest + 2.5 * inflight, (got, largest)


def test_whole_tensor_load_exceeds_the_streaming_budget(wide):
    """The measurement can fail: the pre-streaming path breaks the same budget."""
    largest = max(f.stat().st_size for f in wide.glob("model-*.safetensors"))
    got = _run(MEASURE, str(wide), "whole")
    print(f"whole: extra {got['extra'] / 2**20:.1f} MiB, model {got['model'] / 2**20:.1f} MiB")
    assert got["extra"] > got["model"] + 1.5 * largest, (got, largest)


SPLIT = """
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jlco.checkpoint.load as L
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("e",))

    def by_axes(path, var):
        axes = var.get_metadata().get("out_sharding") or ()
        return NamedSharding(mesh, P(*("e" if a in ("expert", "heads") else None
                                       for a in axes)))

    _, one, _ = L.load_model(sys.argv[1], {"dtype": "float32"}, progress=False)
    _, four, _ = L.load_model(sys.argv[1], {"dtype": "float32"}, shardings=by_axes,
                              progress=False)
    ref = dict(nnx.to_flat_state(nnx.state(one)))
    split = checked = 0
    for path, var in nnx.to_flat_state(nnx.state(four)):
        x, whole = var.get_value(), np.asarray(ref[path].get_value())
        assert len(x.addressable_shards) == 4
        split += not x.sharding.is_fully_replicated
        for s in x.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), whole[s.index], err_msg=str(path))
            checked += 1
        assert np.asarray(x).tobytes() == whole.tobytes(), path
    if len(sys.argv) > 2:   # the Orbax copy restores onto the same shardings
        cfg = L.open_hf_checkpoint(sys.argv[1], cfg_overrides={"dtype": "float32"}).config
        L.save_orbax(sys.argv[2], cfg, nnx.state(four))
        _, back, _ = L.load_model(sys.argv[2], shardings=by_axes)
        for path, var in nnx.to_flat_state(nnx.state(back)):
            x, whole = var.get_value(), np.asarray(ref[path].get_value())
            assert x.sharding == dict(nnx.to_flat_state(nnx.state(four)))[path].sharding, path
            for s in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), whole[s.index])
    print(json.dumps({"split": split, "checked": checked}))
"""


def test_four_devices_each_hold_their_exact_slice(small, tmp_path):
    """XLA host platform with 4 devices; experts (and attention heads) split 4 ways:
    every device's shard equals the same slice of the single-device load, bit for bit
    (fp8 source: block scales are applied per slice); an Orbax copy restores onto the
    same shardings."""
    for src, orbax in (("sharded", [str(tmp_path / "orbax")]), ("fp8", [])):
        got = _run(SPLIT, str(small / src), *orbax,
                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
        assert got["split"] >= 8 and got["checked"] > 100, got


def test_shardings_forms_and_errors(small):
    """`shardings` as one Sharding, a callable, or a pytree like the state; anything
    else is an error naming the parameter."""
    import jax
    from flax import nnx

    from jlco.checkpoint.load import abstract_model, load_model
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    cfg, ref, _ = load_model(small / "sharded", {"dtype": "float32"}, progress=False)
    tree = jax.tree.map(lambda _: one, nnx.to_pure_dict(abstract_model(cfg)[1]))
    seen = []
    for form in (one, tree, lambda path, var: seen.append(path) or one):
        _, m, _ = load_model(small / "sharded", {"dtype": "float32"}, shardings=form,
                             progress=False)
        for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(m)),
                                  nnx.to_flat_state(nnx.state(ref))):
            assert a.get_value().sharding == one, p
            np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    assert ("layers", 1, "mlp", "experts", "up_proj") in seen
    with pytest.raises(TypeError, match=r"shardings gives str for parameter embed_tokens"):
        load_model(small / "sharded", {"dtype": "float32"}, shardings=lambda p, v: "x",
                   progress=False)
