"""Roofline plot (PNG) of one training step, from the report dict of :func:`memtrain.analysis.flops.roofline.flops_report`.

Log-log axes: x is arithmetic intensity (FLOP per byte moved), y attainable FLOP/s. The roof is
``min(peak, bandwidth x intensity)``; a GPU has two compute ceilings, the tensor-core peak of the
run's precision (matmuls) and the FP32 vector peak (everything else), drawn as two flat roofs
over one memory slope. Each operation class is one labelled point at its intensity:

* without a profile, at its attainable FLOP/s (on its roof), sized by its share of the roofline
  time estimate ``max(FLOPs / peak, bytes / bandwidth)``;
* with a measured profile, at its achieved FLOP/s (counted FLOPs / measured time), sized by its
  share of the measured time; a faint ring marks where the roof would put it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memtrain.report.labels import model_label
from memtrain.report.plots import save_figure

# One colour per class, matmuls in blues/greens, element-wise in warm colours, so the
# compute-bound group reads apart from the memory-bound group at a glance.
_COLORS = {
    "qkv": "#1f77b4", "attn_proj": "#17becf", "mlp_fc": "#2ca02c", "mlp_fc_out": "#98df8a",
    "attn_scores": "#9467bd", "attn_values": "#c5b0d5", "attn_fused": "#8c564b", "lm_head": "#08306b",
    "embedding": "#7f7f7f", "layernorm": "#ff7f0e", "softmax": "#d62728", "gelu": "#e377c2",
    "dropout": "#bcbd22", "loss": "#ff9896", "optimizer": "#8c6d31", "other": "#c7c7c7",
}


def _plt() -> Any:
    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    import matplotlib

    matplotlib.use("Agg")
    # after matplotlib.use: pyplot picks its backend when first imported
    import matplotlib.pyplot as plt

    return plt


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _place_labels(ax: Any, points: list[tuple[float, float, str, float, bool]], avoid: list[Any]) -> None:
    """Label each point with a leader line, trying offsets until the text overlaps no earlier
    label, no marker and nothing in ``avoid`` (legend). Points on the memory slope try spots
    perpendicular to it first (upper left, lower right), points on a flat roof above and below,
    so labels do not sit on the roof line. Greedy; enough for the ~15 classes of a step."""
    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    from matplotlib.text import Text

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    taken = []
    for x, y, _, size, _ in points:  # marker boxes, in display pixels
        cx, cy = ax.transData.transform((x, y))
        r = (size ** 0.5) * fig.dpi / 72 / 2
        taken.append((cx - r, cy - r, cx + r, cy + r))
    for artist in avoid:
        bb = artist.get_window_extent(renderer)
        taken.append((bb.x0, bb.y0, bb.x1, bb.y1))
    steps = (14, 28, 44, 62, 82, 104)
    slope = [o for d in steps for o in ((-d, d), (d, -d), (-1.6 * d, 0.5 * d), (1.6 * d, -0.5 * d))]
    flat = [o for d in steps for o in ((0, d), (0, -d - 8), (-d, d), (d, -d - 8), (d, d), (-d, -d - 8))]
    ax_box = ax.get_window_extent(renderer)
    for x, y, text, size, on_slope in points:
        pad = (size ** 0.5) / 2
        placed = None
        for dx, dy in (slope if on_slope else flat):
            dx2 = dx + (pad if dx > 0 else -pad if dx < 0 else 0)
            dy2 = dy + (pad if dy > 0 else -pad if dy < 0 else 0)
            ann = ax.annotate(
                text, (x, y), xytext=(dx2, dy2), textcoords="offset points", fontsize=8.5,
                ha="left" if dx > 0 else "right" if dx < 0 else "center", va="bottom" if dy >= 0 else "top",
                arrowprops=dict(arrowstyle="-", color="0.45", lw=0.6, shrinkA=1, shrinkB=pad),
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8),
            )
            ann.update_positions(renderer)  # resolve the offset into display pixels
            bb = Text.get_window_extent(ann, renderer)  # the text alone (Annotation's includes the leader)
            box = (bb.x0 - 2, bb.y0 - 1, bb.x1 + 2, bb.y1 + 1)
            inside = ax_box.x0 <= box[0] and box[2] <= ax_box.x1 and ax_box.y0 <= box[1] and box[3] <= ax_box.y1
            clash = any(not (box[2] < t[0] or box[0] > t[2] or box[3] < t[1] or box[1] > t[3]) for t in taken)
            if inside and not clash:
                placed = box
                break
            ann.remove()
        if placed is None:  # every spot taken: put it at the first offset anyway
            dx, dy = (slope if on_slope else flat)[0]
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8.5,
                              arrowprops=dict(arrowstyle="-", color="0.45", lw=0.6))
            ann.update_positions(renderer)
            bb = Text.get_window_extent(ann, renderer)
            placed = (bb.x0, bb.y0, bb.x1, bb.y1)
        taken.append(placed)


def _legend(ax: Any, measured: bool) -> Any:
    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], marker="o", ls="", color="0.6", markeredgecolor="black", label="matmul (tensor cores)"),
        Line2D([], [], marker="s", ls="", color="0.6", markeredgecolor="black", label="element-wise (vector units)"),
    ]
    size = "marker area = share of measured time" if measured else "marker area = share of estimated time"
    handles.append(Line2D([], [], ls="", label=size))
    return ax.legend(handles=handles, loc="upper left", fontsize=8.5, framealpha=0.95)


def plot_roofline(report: dict[str, Any], path: str | Path, title: Optional[str] = None) -> Path:
    """Write the roofline PNG of ``report`` (from ``flops_report``) to ``path``; return it."""
    plt = _plt()
    # numpy loads only when a plot is drawn: the CLI's start-up imports this module
    import numpy as np

    path = Path(path)
    gpu = report["gpu"]
    bw, peak, vector = gpu["mem_bandwidth"], gpu["peak_flops"], gpu["vector_peak_flops"]
    measured = "measured" in report
    ops = [o for o in report["ops"] if o["flops"] > 0 and o["bytes"] > 0]
    share_key = "measured_time_share" if measured else "est_time_share"

    xs = [o["intensity"] for o in ops]
    ys = [(o.get("achieved_flops_per_s") or o["attainable_flops_per_s"]) if measured else o["attainable_flops_per_s"]
          for o in ops]
    x_lo = 10 ** np.floor(np.log10(min(xs + [gpu["vector_ridge"]]) / 3))
    x_hi = 10 ** np.ceil(np.log10(max(xs + [gpu["ridge"]]) * 8))
    y_lo = 10 ** np.floor(np.log10(min(ys) / 4))
    y_hi = peak * 4

    fig, ax = plt.subplots(figsize=(11, 7), dpi=150)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    grid = np.logspace(np.log10(x_lo), np.log10(x_hi), 400)
    ax.plot(grid, np.minimum(peak, bw * grid), color="black", lw=2.2,
            label=f"roof: {_si(peak, 'FLOP/s')} {gpu['dtype']} matmul peak, {_si(bw, 'B/s')} memory")
    if vector < peak * 0.999:
        ax.plot(grid, np.minimum(vector, bw * grid), color="black", lw=1.2, ls="--",
                label=f"FP32 vector roof {_si(vector, 'FLOP/s')} (element-wise ops)")
    ridge = gpu["ridge"]
    ax.axvline(ridge, color="0.5", ls=":", lw=1)
    ax.text(ridge * 1.08, y_lo * 1.6, f"ridge {ridge:.0f} FLOP/B\nmemory-bound left, compute-bound right",
            fontsize=8.5, color="0.35", va="bottom")

    # Classes at the same spot (QK^T and AV have equal FLOPs and bytes) share one label.
    groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for o, x, y in zip(ops, xs, ys):
        groups.setdefault((round(x, 9), round(y, 3)), []).append(o)
        share = o.get(share_key) or 0.0
        size = 40 + 2200 * share
        marker = "o" if o["unit"] == "tensor" else "s"
        if measured:
            ax.scatter([x], [o["attainable_flops_per_s"]], s=size, facecolors="none",
                       edgecolors=_COLORS.get(o["name"], "0.5"), linewidths=0.8, alpha=0.5, zorder=2)
        ax.scatter([x], [y], s=size, color=_COLORS.get(o["name"], "0.5"), marker=marker,
                   edgecolors="black", linewidths=0.6, alpha=0.9, zorder=3)
    labels = []
    for (x, y), members in groups.items():
        shares = [m.get(share_key) or 0.0 for m in members]
        text = " + ".join(m["label"] for m in members) + "  " + " + ".join(f"{s * 100:.0f}%" for s in shares)
        on_slope = all(m["attainable_flops_per_s"] < 0.98 * (peak if m["unit"] == "tensor" else vector)
                       for m in members)
        labels.append((x, y, text, 40 + 2200 * max(shares), on_slope))
    cfg = report.get("config", {})
    model = cfg.get("model", {})
    tech = cfg.get("technique", {})
    default_title = (
        f"Roofline of one training step on {gpu['name']}: {model_label(model)}, "
        f"{model.get('n_layers')} layers, vocab {model.get('vocab_size')}, "
        f"batch {cfg.get('batch_size')} x {cfg.get('seq_len')}, {tech.get('precision')}"
    )
    ax.set_title(title or default_title, fontsize=11)
    legend = _legend(ax, measured)
    ax.set_xlabel("arithmetic intensity (FLOP per byte read + written)")
    ax.set_ylabel("FLOP/s")
    ax.grid(True, which="major", color="0.9", lw=0.6)
    # Fix the layout before placing labels: label clashes are tested in display pixels.
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    # Label the biggest first: they get the best spots.
    labels.sort(key=lambda p: -p[3])
    _place_labels(ax, labels, [legend])

    how = ("points at achieved FLOP/s (counted FLOPs / measured time); size = share of measured time; "
           "rings = roof" if measured else
           "points at attainable FLOP/s on the roof (not measured); size = share of the roofline time "
           "estimate max(FLOPs/peak, bytes/bandwidth)")
    total = report.get("total_flops", 0)
    fig.text(0.01, 0.01,
             f"{how}.\nFLOPs per step {_si(total, 'FLOP')} (FlopCounterMode + analytic element-wise/optimizer); "
             f"bytes = inputs + outputs of each eager kernel, {_si(report.get('total_bytes', 0), 'B')} per step.",
             fontsize=8, color="0.3", va="bottom")
    save_figure(fig, path, dpi="figure")
    return path
