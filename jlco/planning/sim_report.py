"""What `python -m jlco.sim` shows of a `throughput.run` result: the readable table
(calibration, ESS's held-out rows with their fetch stall, predictions, the 128K
sensitivity) and the PNG plots."""

from __future__ import annotations

from jlco.planning import sensitivity


def plot(out: dict, plot_dir: str) -> list[str]:
    """throughput_vs_batch.png (per setup, with/without offload) and misses_vs_hot.png."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jlco.util import atomic

    os.makedirs(plot_dir, exist_ok=True)
    setups = dict(out["predictions"], **{"32k_mtp2_accept1.7 (calibration)":
                                         out["calibration_setup_curves"]})
    fig, axes = plt.subplots(1, len(setups), figsize=(5 * len(setups), 4), squeeze=False)
    for ax, (name, p) in zip(axes[0], setups.items()):
        for key, label in (("curve_no_offload", "no offload"), ("curve_offload", "offload")):
            ax.plot([d["batch"] for d in p[key]], [d["node_tokens_s"] for d in p[key]],
                    marker=".", label=label)
        ax.set(title=name, xlabel="batch per GPU", ylabel="node tokens/s")
        ax.legend()
    paths = [os.path.join(plot_dir, "throughput_vs_batch.png")]
    fig.tight_layout()
    with atomic.temp_sibling(paths[0]) as tmp:   # never a half-written PNG
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    mc = out["miss_curve_32k_mtp2"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(mc["capacities"], mc["misses_per_req_step_all_layers"], marker=".")
    ax.set(xscale="log", xlabel="hot-buffer rows per request per layer",
           ylabel="synthetic LRU misses / request / step (61 layers)",
           title="32K, MTP 2 (s_q 3), ESS overlap profile")
    paths.append(os.path.join(plot_dir, "misses_vs_hot.png"))
    fig.tight_layout()
    with atomic.temp_sibling(paths[1]) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return paths


def format_table(out: dict) -> str:
    lines = ["fitted constants: " + ", ".join(f"{k}={v:.4g}" for k, v in
                                               out["fitted_constants"].items()),
             f"{'batch':>6} {'r':>5} {'target tok/s':>13} {'sim tok/s':>10} {'err %':>7}"]
    for c in out["calibration"]:
        lines.append(f"{c['batch']:>6} {c['ratio']:>5.2f} {c['target_tokens_s']:>13.1f} "
                     f"{c['sim_tokens_s']:>10.1f} {c['error_pct']:>7.2f}")
    lines.append("ESS published rows, never fitted (Table 2): setting, batch, r, target / "
                 "sim tok/s, err %, fetch stall ms overlapped / not")
    for h in out.get("published_held_out", []):
        f = h["fetch"]
        lines.append(f"  {h['setting']:<20} {h['batch']:>4} {h['ratio']:>5.2f} "
                     f"{h['target_tokens_s']:>9.1f} {h['sim_tokens_s']:>9.1f} "
                     f"{h['error_pct']:>+6.1f} {f['stall_ms_overlap']:>6.1f} "
                     f"{f['stall_ms_no_overlap']:>6.1f}")
    u = out["indexer_uncertainty"]
    lines.append(f"indexer cost: +-{100 * u['indexer_rel_uncertainty']:.0f}% (max residual "
                 f"{100 * u['max_abs_residual']:.2f}% / indexer share of a 32K step >= "
                 f"{100 * u['calibration_indexer_share_min']:.1f}%)")
    lines.append(f"{'prediction':<22} {'B dev':>6} {'tok/s dev':>10} {'B off':>6} {'r':>5} "
                 f"{'tok/s off':>10} {'+-%':>5} {'idx %':>5} {'x':>5}")
    for name, p in out["predictions"].items():
        d, o = p["no_offload"], p["offload"]
        b = o.get("band", {})
        lines.append(f"{name:<22} {d['batch']:>6} {d['node_tokens_s']:>10.1f} {o['batch']:>6} "
                     f"{o['ratio']:>5.2f} {o['node_tokens_s']:>10.1f} "
                     f"{100 * b.get('rel_band', float('nan')):>5.1f} "
                     f"{100 * b.get('indexer_share', float('nan')):>5.1f} {p['speedup']:>5.2f}")
        if b:
            lines.append(f"{'':<22} offload tok/s band {b['node_tokens_s_lo']:.0f} .. "
                         f"{b['node_tokens_s_hi']:.0f}")
    for name, sens in out.get("sensitivity", {}).items():
        if name.startswith("128k"):
            lines += sensitivity.format_rows(name, sens)
    return "\n".join(lines)
