"""jlco.planning.roofline: one decode step's bytes and FLOPs, checked against numbers
computed by hand for a tiny config, and the machines it divides by."""
import pytest

from jlco.config import CacheConfig, Config, EngineConfig, ModelConfig
from jlco.planning import roofline


def tiny(dtype="bfloat16", key_format="fp8", **model):
    """hidden 8, vocab 16, 2 layers (1 dense + 1 MoE), 2 heads (nope 4, rope 2, v 4),
    q_lora 4, kv_lora 8, 4 experts (k 2, 1 shared, inter 4), dense inter 12, indexer
    2 heads x 4, top-k 3; bf16 latent rows: 2 B x (8 + 2) = 20 B."""
    m = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, moe_intermediate_size=4,
                    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
                    q_lora_rank=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                    v_head_dim=4, n_routed_experts=4, n_shared_experts=1,
                    num_experts_per_tok=2, n_group=1, topk_group=1, index_n_heads=2,
                    index_head_dim=4, index_topk=3, max_position_embeddings=64,
                    rope_scaling=None, num_nextn_predict_layers=0, dtype=dtype, **model)
    return Config(model=m, cache=CacheConfig(kv_format="bf16", indexer_key_format=key_format),
                  engine=EngineConfig(max_context_len=64))


def test_bytes_and_flops_by_hand():
    cfg = tiny()
    assert cfg.row_bytes == 20
    s = roofline.decode_step_cost(cfg, 2, [10, 5])          # 2 requests, 1 query token each
    assert s.bytes == dict(
        embed=2 * 8 * 2,                # 2 token rows x hidden 8 x 2 B
        lm_head=16 * 8 * 2,             # vocab x hidden x 2 B
        # q_a 8x4 + q_b 4x(2x6) + kv_a 8x10 + kv_b 8x(2x8) + o 8x8 = 352 params, 2 layers
        attention=2 * 352 * 2,
        # wq_b 4x8 + wk 8x4 = 64 params x 2 B, + weights_proj 8x2 = 16 params x 4 B (f32)
        indexer=2 * (64 * 2 + 16 * 4),
        # per layer 2x8 + 4 + 8 + 2x4 = 36 params, + final norm 8
        norms=(2 * 36 + 8) * 2,
        router=(4 * 8 + 4) * 4,         # one MoE layer, f32 weight + bias
        routed_experts=4 * 96 * 2,      # min(E 4, 2 tokens x k 2) experts x 3x8x4 params
        shared_experts=96 * 2,
        dense_ffn=3 * 8 * 12 * 2,       # one dense layer
        index_keys=2 * (10 + 5) * 8,    # fp8 keys: 4 B + 4 B scale per token, 2 layers
        latent_rows=2 * (3 + 3) * 20,   # min(top-k 3, 11) + min(3, 6) rows, 2 layers
        cache_writes=2 * 2 * (20 + 8),  # 2 new tokens x (row + key), 2 layers
    )
    assert s.total_bytes == 4512
    assert s.experts_touched == 4
    # matmul params per token: attention 2x352 + indexer 2x(64 + 16) + router 32
    # + (k 2 + shared 1) x 96 + dense 288 + lm_head 128 = 1600
    assert s.flops == dict(matmul=2 * 1600 * 2,
                           indexer_scores=2 * (2 * 2 * 4) * (11 + 6),
                           sparse_mla=2 * (2 * 2 * (10 + 8)) * (3 + 3))
    assert s.total_flops == 7808
    m = roofline.Machine("toy", mem_bw=1000.0, peak_flops=1000.0)
    assert s.memory_s(m) == 4.512 and s.compute_s(m) == 7.808 and s.time_s(m) == 7.808
    assert s.as_dict(m)["bound"] == "compute"


def test_union_of_experts_queries_and_key_formats():
    cfg = tiny()
    one = roofline.decode_step_cost(cfg, 1, 10)
    assert one.experts_touched == 2 and one.bytes["routed_experts"] == 2 * 96 * 2
    # s_q = 3: query j of a request sees c + j + 1 positions.
    spec = roofline.decode_step_cost(cfg, 1, 1, s_q=3)
    assert spec.experts_touched == 4                  # min(E 4, 3 tokens x k 2)
    assert spec.bytes["latent_rows"] == 2 * (2 + 3 + 3) * 20
    assert spec.flops["indexer_scores"] == 2 * 2 * 2 * 4 * (2 + 3 + 4)
    assert spec.bytes["index_keys"] == 2 * 1 * 8      # stored keys only; new ones are writes
    # bf16 keys: 2 B per element in a bf16 model, 4 B in a float32 model (weights too).
    assert roofline.decode_step_cost(tiny(key_format="bf16"), 1, 10).bytes["index_keys"] \
        == 2 * 10 * 8
    f32 = roofline.decode_step_cost(tiny("float32", "bf16"), 1, 10)
    assert f32.bytes["index_keys"] == 2 * 10 * 16
    assert f32.bytes["lm_head"] == 16 * 8 * 4
    # tied embeddings: the head reads the whole table, no separate row reads.
    assert roofline.decode_step_cost(tiny(tie_word_embeddings=True), 1, 10).bytes["embed"] == 0


@pytest.mark.parametrize("batch, contexts, s_q, match", [
    (0, 10, 1, "batch"), (2, [1], 1, "contexts"), (1, [-1], 1, "contexts"), (1, 3, 0, "s_q"),
])
def test_bad_arguments(batch, contexts, s_q, match):
    with pytest.raises(ValueError, match=match):
        roofline.decode_step_cost(tiny(), batch, contexts, s_q=s_q)


def test_machines():
    cpu = roofline.cpu_machine(30.0, 200.0)
    assert cpu.mem_bw == 30e9 and cpu.peak_flops == 200e9 and cpu.host_bw is None
    assert cpu.source == "30.0 GB/s given, 200.0 GFLOP/s given"
    h200 = roofline.hardware_machine("h200")
    assert h200.mem_bw == 4800e9 and h200.peak_flops == 989e12 and h200.host_bw == 64e9
    assert roofline.profile_for_device_kind("NVIDIA H200") == "h200"
    assert roofline.profile_for_device_kind("NVIDIA H20") == "h20"
    assert roofline.profile_for_device_kind("TPU v5 lite") == "tpu_v5e"
    assert roofline.profile_for_device_kind("cpu") is None
    with pytest.raises(ValueError):
        roofline.cpu_machine(0, 1)


def test_real_model_is_memory_bound_on_h200():
    """DeepSeek-V3.2 (61 layers, bf16 weights here), batch 16 at 32K: weights dominate
    the bytes; the step is memory-bound on an H200 and takes milliseconds."""
    cfg = Config(cache=CacheConfig(kv_format="fp8", indexer_key_format="fp8"),
                 engine=EngineConfig(max_context_len=32768))
    s = roofline.decode_step_cost(cfg, 16, 32768)
    m = roofline.hardware_machine("h200")
    assert s.experts_touched == 128                   # min(256, 16 x 8)
    assert s.bytes["index_keys"] == 61 * 16 * 32768 * 132
    assert s.bytes["latent_rows"] == 61 * 16 * 2048 * 656
    assert s.memory_s(m) > s.compute_s(m) and 1e-3 < s.time_s(m) < 1.0


def test_cpu_limits_are_measured_here_and_cached_per_machine(tmp_path, monkeypatch):
    """No constant of another box: the figures come from the probe, measured once (the
    fastest of its runs) and read back; a cache file others may write is measured again;
    a probe taken while other work loads the cores is not kept."""
    from jlco.planning import probe
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(probe, "read_gbps", lambda *a, **k: calls.append("r") or 21.0)
    monkeypatch.setattr(probe, "matmul_gflops", lambda *a, **k: calls.append("m") or 150.0)
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    cpu = roofline.cpu_machine()
    assert (cpu.mem_bw, cpu.peak_flops) == (21e9, 150e9) and calls == ["r", "m"]
    assert cpu.source.startswith("measured on this machine (21.0 GB/s read at 134 MB, "
                                 "150 GFLOP/s f32 matmul; jlco.planning.probe")
    path = probe.cache_path()
    assert path.is_file() and (path.parent.stat().st_mode & 0o777) == 0o700
    assert roofline.cpu_machine(25.0).mem_bw == 25e9 and calls == ["r", "m"]   # read back
    path.chmod(0o666)
    roofline.cpu_machine()
    assert calls == ["r", "m"] * 2      # not trusted: measured again (and rewritten)
    path.unlink()
    monkeypatch.setattr(probe.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert "not cached: load average 9.0" in roofline.cpu_machine().source
    assert not path.exists()
    with pytest.raises(ValueError, match="mem_gbps=0 is invalid: allowed a positive number"):
        roofline.cpu_machine(0, 1)
