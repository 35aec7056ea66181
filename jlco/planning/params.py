"""Model size per unit: parameter counts per layer, expert and dense FFN, and the weight
bytes one rank holds (routed experts split over `ep` ranks) in fp8 / bf16 / f32 storage.
Shared by the memory planner and the throughput simulator.
"""

from __future__ import annotations

import dataclasses
import math

from jlco.config import ModelConfig

WEIGHT_FORMATS = ("fp8", "bf16", "f32")
_BLOCK = 128  # fp8 weights carry one f32 scale per 128 x 128 block (docs/facts.md §1)


def param_counts(m: ModelConfig) -> dict[str, int]:
    """Parameters per unit: per layer (attention, indexer, norms), per expert, per dense
    FFN, and the whole-model pieces (embedding, head, router per layer, MTP extras)."""
    h, nh = m.hidden_size, m.num_attention_heads
    return dict(
        attention=sum(i * o for i, o in _attn_linears(m)),
        indexer=sum(i * o for i, o in _indexer_fp8(m)) + h * m.index_n_heads,
        norms=2 * h + m.q_lora_rank + m.kv_lora_rank + 2 * m.index_head_dim,
        expert=3 * h * m.moe_intermediate_size,
        dense_ffn=3 * h * m.intermediate_size,
        router=m.n_routed_experts * h + m.n_routed_experts,
        embed=m.vocab_size * h, lm_head=m.vocab_size * h,
        mtp_extra=2 * h * h + 3 * h, mtp_head=m.vocab_size * h, final_norm=h, heads=nh,
    )


def _attn_linears(m: ModelConfig) -> list[tuple[int, int]]:
    nh = m.num_attention_heads
    return [(m.hidden_size, m.q_lora_rank), (m.q_lora_rank, nh * m.qk_head_dim),
            (m.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim),
            (m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim)),
            (nh * m.v_head_dim, m.hidden_size)]


def _indexer_fp8(m: ModelConfig) -> list[tuple[int, int]]:
    return [(m.q_lora_rank, m.index_n_heads * m.index_head_dim),
            (m.hidden_size, m.index_head_dim)]


def _linear_bytes(shapes: list[tuple[int, int]], fmt: str) -> int:
    """Bytes of linear weights: fp8 = 1 B/param + one f32 scale per 128 x 128 block."""
    if fmt == "fp8":
        return sum(i * o + 4 * math.ceil(i / _BLOCK) * math.ceil(o / _BLOCK) for i, o in shapes)
    return sum(i * o for i, o in shapes) * (2 if fmt == "bf16" else 4)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Weight bytes held by one rank (routed experts split over `ep` ranks)."""
    embed_and_head: int
    attention: int
    indexer: int
    dense_ffn: int
    routed_experts: int
    shared_experts: int
    router_and_norms: int
    mtp: int
    params_total: int
    params_rank: int

    @property
    def total(self) -> int:
        return (self.embed_and_head + self.attention + self.indexer + self.dense_ffn
                + self.routed_experts + self.shared_experts + self.router_and_norms + self.mtp)


def weight_bytes(m: ModelConfig, ep: int = 1, weight_format: str = "fp8") -> WeightBytes:
    """Per-rank weight bytes. fp8 checkpoints keep linears in e4m3 + block scales and
    embeddings, head, norms, router and indexer weights_proj in bf16 (f32 for 'f32')."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} is invalid: allowed {WEIGHT_FORMATS}")
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep={ep!r} is invalid: allowed a positive integer")
    hi = 4 if weight_format == "f32" else 2
    p, nl, h = param_counts(m), m.num_hidden_layers, m.hidden_size
    n_moe = nl - m.first_k_dense_replace
    mtp = m.num_nextn_predict_layers
    e_shapes = [(h, m.moe_intermediate_size)] * 2 + [(m.moe_intermediate_size, h)]
    d_shapes = [(h, m.intermediate_size)] * 2 + [(m.intermediate_size, h)]
    expert_b = _linear_bytes(e_shapes, weight_format)
    local = math.ceil(m.n_routed_experts / ep)
    attn_b = _linear_bytes(_attn_linears(m), weight_format)
    idx_b = _linear_bytes(_indexer_fp8(m), weight_format) + hi * h * m.index_n_heads
    small = hi * (p["norms"] + p["router"])
    mtp_b = mtp * (attn_b + idx_b + small + (local + m.n_shared_experts) * expert_b
                   + hi * (p["mtp_extra"] + p["mtp_head"]))
    per_layer = p["attention"] + p["indexer"] + p["norms"]
    total = (p["embed"] + p["lm_head"] + p["final_norm"]
             + (nl + mtp) * per_layer + m.first_k_dense_replace * p["dense_ffn"]
             + (n_moe + mtp) * ((m.n_routed_experts + m.n_shared_experts) * p["expert"]
                                + p["router"]) + mtp * (p["mtp_extra"] + p["mtp_head"]))
    rank = total - (n_moe + mtp) * (m.n_routed_experts - local) * p["expert"]
    return WeightBytes(
        embed_and_head=hi * (p["embed"] + p["lm_head"] + p["final_norm"]),
        attention=nl * attn_b, indexer=nl * idx_b,
        dense_ffn=m.first_k_dense_replace * _linear_bytes(d_shapes, weight_format),
        routed_experts=n_moe * local * expert_b,
        shared_experts=n_moe * m.n_shared_experts * expert_b,
        router_and_norms=nl * hi * p["norms"] + n_moe * hi * p["router"],
        mtp=mtp_b, params_total=total, params_rank=rank)
