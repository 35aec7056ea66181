"""Model size per unit: parameter counts per layer, expert and dense FFN, and the weight
bytes one rank holds (routed experts split over `ep` ranks, matmuls with a head /
intermediate / vocabulary axis split over `tensor` ranks) in fp8 / bf16 / f32 storage.
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


def _attn_linears(m: ModelConfig, tensor: int = 1) -> list[tuple[int, int]]:
    """(in, out) of q_a, q_b, kv_a, kv_b, o_proj. Under tensor parallelism the heads split:
    q_b and kv_b by output columns, o_proj by input rows; the low-rank down projections
    q_a and kv_a (no head axis) are replicated."""
    nh = -(-m.num_attention_heads // tensor)
    return [(m.hidden_size, m.q_lora_rank), (m.q_lora_rank, nh * m.qk_head_dim),
            (m.hidden_size, m.kv_lora_rank + m.qk_rope_head_dim),
            (m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim)),
            (nh * m.v_head_dim, m.hidden_size)]


def _indexer_fp8(m: ModelConfig, tensor: int = 1) -> list[tuple[int, int]]:
    """wq_b (split by index heads under tensor parallelism) and wk (one key head: replicated)."""
    return [(m.q_lora_rank, -(-m.index_n_heads // tensor) * m.index_head_dim),
            (m.hidden_size, m.index_head_dim)]


def _ffn(h: int, inter: int, tensor: int = 1) -> list[tuple[int, int]]:
    """gate, up (split by columns) and down (split by rows) of one FFN / expert."""
    i = -(-inter // tensor)
    return [(h, i)] * 2 + [(i, h)]


def _linear_bytes(shapes: list[tuple[int, int]], fmt: str) -> int:
    """Bytes of linear weights: fp8 = 1 B/param + one f32 scale per 128 x 128 block."""
    if fmt == "fp8":
        return sum(i * o + 4 * math.ceil(i / _BLOCK) * math.ceil(o / _BLOCK) for i, o in shapes)
    return sum(i * o for i, o in shapes) * (2 if fmt == "bf16" else 4)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Weight bytes held by one rank (routed experts split over `ep` ranks, head /
    intermediate / vocabulary axes over `tensor` ranks)."""
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


def _positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} is invalid: allowed a positive integer")


def weight_bytes(m: ModelConfig, ep: int = 1, weight_format: str = "fp8",
                 tensor: int = 1) -> WeightBytes:
    """Per-rank weight bytes. fp8 checkpoints keep linears in e4m3 + block scales and
    embeddings, head, norms, router and indexer weights_proj in bf16 (f32 for 'f32').

    `ep`: ranks the routed experts are split over (ceil(E / ep) whole experts each).
    `tensor`: ranks every matmul with a head, FFN-intermediate or vocabulary axis is split
    over (Megatron style: attention heads, indexer heads and weights_proj, dense FFN,
    shared and routed expert FFNs, embedding and lm_head rows); the low-rank down
    projections (q_a, kv_a, indexer wk), norms and router are replicated. Splits round up."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format={weight_format!r} is invalid: allowed {WEIGHT_FORMATS}")
    _positive("ep", ep)
    _positive("tensor", tensor)
    hi = 4 if weight_format == "f32" else 2
    p, nl, h = param_counts(m), m.num_hidden_layers, m.hidden_size
    n_dense, n_moe, n_idx = layer_counts(m)
    mtp = m.num_nextn_predict_layers
    split = lambda n: -(-n // tensor)  # noqa: E731
    expert_b = _linear_bytes(_ffn(h, m.moe_intermediate_size, tensor), weight_format)
    local = math.ceil(m.n_routed_experts / ep)
    attn_b = _linear_bytes(_attn_linears(m, tensor), weight_format)
    idx_b = (_linear_bytes(_indexer_fp8(m, tensor), weight_format)
             + hi * h * split(m.index_n_heads))
    small = hi * (p["norms"] + p["router"])
    vocab = split(m.vocab_size) * h
    mtp_b = mtp * (attn_b + idx_b + small + (local + m.n_shared_experts) * expert_b
                   + hi * (p["mtp_extra"] + vocab))
    per_layer = p["attention"] + p["indexer"] + p["norms"]
    total = (p["embed"] + p["lm_head"] + p["final_norm"]
             + (nl + mtp) * per_layer - (nl - n_idx) * p["indexer"] + n_dense * p["dense_ffn"]
             + (n_moe + mtp) * ((m.n_routed_experts + m.n_shared_experts) * p["expert"]
                                + p["router"]) + mtp * (p["mtp_extra"] + p["mtp_head"]))
    rank = _rank_params(m, p, local, tensor)
    return WeightBytes(
        embed_and_head=hi * (2 * vocab + p["final_norm"]),
        attention=nl * attn_b, indexer=n_idx * idx_b,
        dense_ffn=n_dense * _linear_bytes(_ffn(h, m.intermediate_size, tensor),
                                                          weight_format),
        routed_experts=n_moe * local * expert_b,
        shared_experts=n_moe * m.n_shared_experts * expert_b,
        router_and_norms=nl * hi * p["norms"] + n_moe * hi * p["router"],
        mtp=mtp_b, params_total=total, params_rank=rank)


def layer_counts(m: ModelConfig) -> tuple[int, int, int]:
    """(dense-MLP, MoE, indexer) main layers: mlp_layer_types or first_k_dense_replace
    decide the first two; a layer that shares its top-k (IndexShare) has no indexer."""
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
    return m.num_hidden_layers - n_moe, n_moe, m.indexer_layers


def _rank_params(m: ModelConfig, p: dict, local: int, tensor: int) -> int:
    """Parameters one rank holds, split as `weight_bytes` splits the bytes."""
    h, nl, mtp = m.hidden_size, m.num_hidden_layers, m.num_nextn_predict_layers
    n_dense, n_moe, n_idx = layer_counts(m)
    count = lambda shapes: sum(i * o for i, o in shapes)  # noqa: E731
    vocab = -(-m.vocab_size // tensor) * h
    idx = count(_indexer_fp8(m, tensor)) + h * -(-m.index_n_heads // tensor)
    per_layer = count(_attn_linears(m, tensor)) + idx + p["norms"]
    expert = count(_ffn(h, m.moe_intermediate_size, tensor))
    return (2 * vocab + p["final_norm"] + (nl + mtp) * per_layer - (nl - n_idx) * idx
            + n_dense * count(_ffn(h, m.intermediate_size, tensor))
            + (n_moe + mtp) * ((local + m.n_shared_experts) * expert + p["router"])
            + mtp * (p["mtp_extra"] + vocab))
