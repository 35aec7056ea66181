"""DeepSeek-V4's config.json reader: transformers' DeepseekV4Config spellings (current
and backward-compatible) give the same V4Config, required fields are required, and
values jlco does not implement are refused naming the key."""

import pytest

from jlco.checkpoint.hf_reference import V4_TINY
from jlco.config import ConfigError, ModelConfig
from jlco.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config


def _saved() -> dict:
    """config.json as transformers writes it for V4_TINY."""
    from transformers import DeepseekV4Config
    return DeepseekV4Config(**V4_TINY).to_dict()


def test_reads_what_transformers_writes():
    cfg = V4Config.from_hf_dict(_saved())
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "hash_moe")
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca) == (4, 8)
    assert (cfg.qk_rope_head_dim, cfg.head_dim, cfg.swiglu_limit) == (4, 16, 1.0)
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.rope_scaling) == (1e4, 1.6e5, None)


def test_backward_compatible_spellings():
    d = _saved()
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim",
                "rope_parameters"):
        del d[key]
    d.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, compress_rate_csa=4,
             compress_rate_hca=8, partial_rotary_factor=0.25,
             rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings":
                           4096, "beta_fast": 32, "beta_slow": 1})
    cfg = V4Config.from_hf_dict(d)
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca, cfg.qk_rope_head_dim) == (4, 8, 4)
    assert cfg.rope_scaling.factor == 16 and cfg.rope_attention_factor == 1.0


def test_default_schedules_match_transformers():
    from transformers import DeepseekV4Config
    hf = DeepseekV4Config(num_hidden_layers=7)
    cfg = V4Config(num_hidden_layers=7)
    assert list(cfg.layer_types) == hf.layer_types
    assert list(cfg.mlp_layer_types) == hf.mlp_layer_types


@pytest.mark.parametrize("key", ["hidden_size", "sliding_window", "index_topk", "hc_mult"])
def test_required_fields(key):
    d = _saved()
    del d[key]
    with pytest.raises(ConfigError, match=f"missing required field.*'{key}'"):
        V4Config.from_hf_dict(d)


def test_layer_schedule_is_required():
    d = _saved()
    del d["layer_types"]
    with pytest.raises(ConfigError, match="'layer_types' or 'compress_ratios'"):
        V4Config.from_hf_dict(d)


@pytest.mark.parametrize("key, value, match", [
    ("layer_types", ["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention"], "'layer_types'"),
    ("mlp_layer_types", ["moe", "dense", "moe", "moe"], "'mlp_layer_types'"),
    ("compress_ratios", [0, 4, 64, 4], "'compress_ratios'"),
    ("scoring_func", "softmax", "model.scoring_func"),
    ("hidden_act", "gelu", "'hidden_act'"),
    ("quantization_config", {"quant_method": "gptq"}, "quantization_config.quant_method"),
    ("expert_dtype", "fp6", "'expert_dtype'"),
    ("o_groups", 3, "model.o_groups"),
])
def test_unknown_values_are_refused(key, value, match):
    d = _saved()
    if key == "compress_ratios":
        del d["layer_types"]
    d[key] = value
    with pytest.raises(ConfigError, match=match):
        V4Config.from_hf_dict(d)


def test_modelconfig_refuses_deepseek_v4():
    with pytest.raises(ConfigError, match="V4Config"):
        ModelConfig.from_hf_dict(_saved())
    with pytest.raises(ConfigError, match="V4Config"):
        ModelConfig(model_type="deepseek_v4")


def test_engine_load_refuses_deepseek_v4(tmp_path):
    """The MLA loader (load_model) refuses a deepseek_v4 checkpoint, naming the reader
    that takes it (jlco.generate / jlco.serve route it there: tests/engine/test_v4_engine.py)."""
    import json

    from jlco.checkpoint.load import load_model
    from jlco.checkpoint.safetensors_io import CheckpointError
    (tmp_path / "config.json").write_text(json.dumps(_saved()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="deepseek_v4.*V4Config.*read_v4_config"):
        load_model(tmp_path)


def test_state_bytes_at_v4_flash_shapes():
    """Per request at transformers' default (V4-Flash-documented) shapes, bf16, 1M
    tokens: CSA 256 B/token/layer of entries + 64 of indexer keys, HCA 8 B/token/layer,
    W rows of 1 KiB per layer (docs/facts.md §7, "Cache")."""
    from jlco.model.deepseek_v4.state import state_bytes
    cfg = V4Config()
    n = 1 << 20
    b = state_bytes(cfg, n)
    csa = cfg.layer_types.count(CSA)
    hca = cfg.layer_types.count(HCA)
    assert (csa, hca) == (20, 23)
    assert b["csa_entries"] == csa * n * 256 and b["index_keys"] == csa * n * 64
    assert b["hca_entries"] == hca * n * 8
    assert b["window"] == 43 * 128 * 512 * 2
    assert (b["csa_entries"] + b["index_keys"] + b["hca_entries"]) // n == 6584
