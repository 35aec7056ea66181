"""Planner arithmetic against hand-computed numbers (tiny config, made-up hardware)."""
import dataclasses

import pytest

from jlco.config import CacheConfig, ModelConfig, load_config
from jlco.planning import memory as plan
from jlco.planning import params
from jlco.planning.hardware import HARDWARE, HardwareProfile, Sourced, get_hardware

TINY = load_config("configs/tiny.py")
CFG = TINY.replace(cache=CacheConfig(offload=True, kv_format="f32", indexer_key_format="bf16",
                                     page_size=16, hot_buffer_rows=64))
_S = lambda v: Sourced(v, "made up for the test")  # noqa: E731
HW = HardwareProfile("toy", _S(0.01), _S(100.0), _S(1.0), _S(2.0), _S(1.0), _S(0.001))


def test_param_counts_by_hand():
    p = params.param_counts(CFG.model)
    # q_a 64*48 + q_b 48*(4*48) + kv_a 64*144 + kv_b 128*(4*64) + o (4*32)*64
    assert p["attention"] == 3072 + 9216 + 9216 + 32768 + 8192
    # wq_b 48*(16*32) + wk 64*32 + weights_proj 64*16
    assert p["indexer"] == 24576 + 2048 + 1024
    assert p["expert"] == 3 * 64 * 32 and p["dense_ffn"] == 3 * 64 * 128
    assert p["norms"] == 2 * 64 + 48 + 128 + 2 * 32


def test_weight_bytes_bf16_ep2_by_hand():
    w = params.weight_bytes(CFG.model, ep=2, weight_format="bf16")
    assert w.embed_and_head == 2 * (2 * 512 * 64 + 64)
    assert w.attention == 3 * 2 * 62464
    assert w.indexer == 3 * (2 * (24576 + 2048) + 2 * 64 * 16)
    assert w.dense_ffn == 2 * 24576
    assert w.routed_experts == 2 * 4 * 2 * 6144  # 2 MoE layers x 4 local experts
    assert w.shared_experts == 2 * 2 * 6144
    assert w.router_and_norms == 3 * 2 * 368 + 2 * 2 * 520
    # MTP: attention, indexer, norms+router, 4 local + 1 shared expert, eh_proj + 3 norms,
    # and its own shared_head.head (v x d): a separate tensor the model loads
    assert w.mtp == 124928 + 55296 + 2 * (368 + 520) + 5 * 12288 + 2 * 8384 + 2 * 512 * 64
    assert w.total == 1_173_936


def test_fp8_block_scales():
    # 300 x 130 weight: 39000 bytes + f32 scale per 128x128 block: 3 x 2 blocks
    assert params._linear_bytes([(300, 130)], "fp8") == 39000 + 4 * 3 * 2


def test_real_model_param_count():
    w = params.weight_bytes(ModelConfig(), ep=32)
    assert 680e9 < w.params_total < 690e9  # 671B + 14B MTP layer (HF "685B")
    assert 38e9 < w.params_rank < 41e9


def test_max_batch_and_plan_by_hand():
    # per request (context 256, 4 cache layers: 3 + the MTP layer, allocated as the engine
    # does): indexer 256*4*128 (bf16-format keys stay f32 in this f32 model), hot 64*4*576
    # (f32 rows), tables = length 4 + page table 4*16 + slot pos/stamp/prefetched 9*64*4 + the
    # penalty tables 5*512 + 8*300 + 4*64 + 17 = 5233 (util.sampling_tables), activations 256 + 2*4*(144+128)*2 = 4608 bytes per token
    pr = plan.per_request_bytes(CFG, 256, True)
    assert pr == dict(indexer=131072, latent_device=147456, tables=7605, activations=4608,
                      host=589824)
    assert plan.per_request_bytes(CFG, 256, False)["tables"] == 4 + 5233
    free = 10_000_000 - 1_000_000 - 1_173_936
    kw = dict(ep=2, context=256, reserve_bytes=1_000_000, weight_format="bf16")
    assert plan.max_batch(CFG, 1e7, offload=True, **kw) == free // 290485 == 26
    assert plan.max_batch(CFG, 1e7, offload=False, **kw) == free // 730741 == 10
    p = plan.plan(CFG, HW, ep=2, context=256, miss_rate=0.5, weight_format="bf16")
    assert (p.max_batch_offload, p.max_batch_no_offload, p.config_cap) == (26, 10, 4)
    assert (p.batch_offload, p.batch_no_offload) == (4, 4)
    assert p.host_bytes_needed == pytest.approx(4 * 589824 * 1.3)
    t = p.transfer
    assert t.miss_rows_per_step == pytest.approx(0.5 * 4 * 3 * 32)
    assert t.transfer_s == pytest.approx(192 * 576 / 1e9)
    assert t.compute_s > 0 and t.hides == (t.transfer_s <= t.compute_s)
    assert (t.warning == "") == t.hides


def test_transfer_warning_when_link_is_slow():
    slow = dataclasses.replace(HW, host_link_gbps=_S(1e-6))
    t = plan.plan(CFG, slow, ep=2, context=256, miss_rate=1.0, weight_format="bf16").transfer
    assert not t.hides and t.warning.startswith("WARNING")


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="ep="):
        params.weight_bytes(CFG.model, ep=0)
    with pytest.raises(ValueError, match="weight_format="):
        params.weight_bytes(CFG.model, weight_format="int4")
    with pytest.raises(ValueError, match="hardware="):
        get_hardware("a100")
    with pytest.raises(ValueError, match="miss_rate="):
        plan.plan(CFG, HW, ep=2, context=256, miss_rate=2.0, weight_format="bf16")


def test_hardware_table_has_sources():
    assert {"h20", "h800", "h100", "h200", "b200", "tpu_v5e", "tpu_v5p", "tpu_v6e"} <= set(HARDWARE)
    for hw in HARDWARE.values():
        for f in dataclasses.fields(hw):
            v = getattr(hw, f.name)
            if isinstance(v, Sourced):
                assert v.value > 0 and len(v.source) > 10, (hw.name, f.name)
        assert hw.fp8_tflops.value >= hw.bf16_tflops.value


def test_128k_plan_offload_admits_more():
    p = plan.plan(load_config("configs/128k.py"), get_hardware("h200"), ep=32,
                  check_transfer=False)
    assert p.max_batch_offload > 3 * p.max_batch_no_offload > 0
