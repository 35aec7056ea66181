"""How much each assumption of the decode-throughput simulator moves its predictions.

Every calibration row is at 32K, so at 128K the prediction rests on how the step's cost
grows with context (indexer keys, FLOPs and logits, the top-k selection, the fetch
volume and how much of it hides: `jlco.planning.throughput`). Here each input is scaled
by ±`STEP` (20 %) on its own, the best point re-chosen (`throughput.predict`: the batch
that maximises node tokens/s, offload on and off), and the change in predicted tokens/s
reported, entries sorted by their larger effect. The fitted constants are held at their
fitted values (no re-fit): the question is what the 128K prediction would be if an
assumption were off, with the 32K calibration as it is.
"""

from __future__ import annotations

import dataclasses

from jlco.planning.hardware import Sourced

STEP = 0.2

# name → (where it lives, field, what it is). "hw": the hardware profile; "setup": the
# `throughput.Setup`; "const": the fitted constants (index into FIT_NAMES order).
ASSUMPTIONS = (
    ("hbm_bandwidth", "hw", "hbm_gbps", "HBM GB/s (weights, indexer keys and logits)"),
    ("fp8_flops", "hw", "fp8_tflops", "dense fp8 TFLOP/s (GEMMs; the indexer scores run "
                                       "at the sparse-attention rate)"),
    ("bf16_flops", "hw", "bf16_tflops", "dense bf16 TFLOP/s (sparse MLA, LM head)"),
    ("h2d_bandwidth", "setup", "h2d_gbps", "host→device GB/s for missed latent rows"),
    ("network_bandwidth", "setup", "net_gbps", "inter-node GB/s per GPU (MoE all-to-all)"),
    ("gemm_eff", "const", 0, "fitted: fraction of peak FLOP/s reached"),
    ("mem_eff", "const", 1, "fitted: fraction of HBM bandwidth reached"),
    ("net_eff", "const", 2, "fitted: fraction of network bandwidth reached"),
    ("miss_rate", "const", 3, "miss_scale, pinned to ESS Fig. 5: real misses / "
                                "synthetic-trace misses"),
    ("layer_overhead_us", "const", 4, "fitted: fixed cost per layer per step"),
    ("indexer_overlap", "setup", "indexer_overlap",
     "share of the indexer the fetch hides behind (DBA: the other micro-batch's)"),
    ("attention_overlap", "setup", "attention_overlap",
     "share of sparse attention the fetch hides behind (DA)"),
    ("topk_passes", "setup", "topk_passes", "top-k reads of the f32 logits"),
    ("indexer_mem_eff", "setup", "indexer_mem_scale",
     "the indexer's HBM efficiency relative to the fitted mem_eff (value: the scale)"),
    ("kv_budget", "setup", "kv_budget", "device bytes for indexer keys + hot buffer"),
)


def scaled(s, consts: tuple, name: str, factor: float):
    """(setup, constants) with assumption `name` multiplied by `factor`."""
    for n, where, field, _ in ASSUMPTIONS:
        if n != name:
            continue
        if where == "const":
            c = list(consts)
            c[field] *= factor
            return s, tuple(c)
        if where == "hw":
            v = getattr(s.hw, field)
            hw = dataclasses.replace(s.hw, **{field: Sourced(v.value * factor, v.source)})
            return dataclasses.replace(s, hw=hw), consts
        return dataclasses.replace(s, **{field: getattr(s, field) * factor}), consts
    raise ValueError(f"sensitivity: assumption {name!r} is invalid: allowed "
                     f"{', '.join(a[0] for a in ASSUMPTIONS)}")


def base_value(s, consts: tuple, name: str) -> float:
    for n, where, field, _ in ASSUMPTIONS:
        if n == name:
            if where == "const":
                return float(consts[field])
            return float(getattr(s.hw, field).value if where == "hw" else getattr(s, field))
    raise ValueError(f"sensitivity: assumption {name!r} is invalid")


def sensitivity(s, consts: tuple, predict) -> dict:
    """±STEP on each assumption of setup `s` → {base, entries sorted by |effect|}.
    `predict(setup, consts)` is `throughput.predict` (passed in: no import cycle)."""
    base = predict(s, consts)
    b_off, b_dev = base["offload"]["node_tokens_s"], base["no_offload"]["node_tokens_s"]
    entries = []
    for name, _, _, what in ASSUMPTIONS:
        e = dict(assumption=name, what=what, value=base_value(s, consts, name))
        for tag, f in (("plus20", 1.0 + STEP), ("minus20", 1.0 - STEP)):
            p = predict(*scaled(s, consts, name, f))
            off, dev = p["offload"], p["no_offload"]
            e[f"{tag}_node_tokens_s"] = off["node_tokens_s"]
            e[f"{tag}_pct"] = 100.0 * (off["node_tokens_s"] / b_off - 1.0)
            e[f"{tag}_batch"] = off["batch"]
            e[f"{tag}_no_offload_pct"] = 100.0 * (dev["node_tokens_s"] / b_dev - 1.0)
        entries.append(e)
    entries.sort(key=lambda e: -max(abs(e["plus20_pct"]), abs(e["minus20_pct"])))
    return dict(step=STEP, base_node_tokens_s=b_off, base_batch=base["offload"]["batch"],
                base_no_offload_node_tokens_s=b_dev, entries=entries,
                note="each assumption scaled by +-20% alone, the best batch re-chosen, "
                     "fitted constants held (no re-fit); pct = change of the offload "
                     "prediction's node tokens/s, sorted by the larger of the two")


def format_rows(name: str, sens: dict) -> list[str]:
    """Table lines for one prediction's sensitivity."""
    lines = [f"sensitivity of {name} (offload, {sens['base_node_tokens_s']:.0f} tok/s at "
             f"batch {sens['base_batch']}): assumption +20% / -20%"]
    for e in sens["entries"]:
        lines.append(f"  {e['assumption']:<20} {e['plus20_pct']:>+7.1f}% {e['minus20_pct']:>+7.1f}%")
    return lines
