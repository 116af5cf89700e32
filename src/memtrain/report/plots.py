"""Bench plots (PNG): peak memory, step time, max batch per technique, and memory vs time."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from memtrain.files.results import PLOT_FILES, write_atomic
from memtrain.report.tables import CATEGORIES, GIB, MAX_PLOT_ROWS, MIB

COLORS = {
    "parameters": "#4C72B0", "gradients": "#55A868", "optimizer": "#C44E52",
    "activations": "#8172B2", "temporaries": "#CCB974",
}


def _plt():
    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    import matplotlib

    matplotlib.use("Agg")
    # after matplotlib.use: pyplot picks its backend when first imported
    import matplotlib.pyplot as plt

    return plt


def _ok(records: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get(key) is not None]


def save_figure(fig: Any, path: Path, dpi: Any = 120) -> None:
    """Write ``fig`` as a PNG to ``path`` atomically (never through a link), then close it."""
    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    import matplotlib.pyplot as plt

    try:
        write_atomic(Path(path), lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    finally:
        plt.close(fig)


# The most characters of a name a plot draws. matplotlib lays text out in time linear in its
# length: a row named with 200,000 characters took `memtrain report` 159 s, one of 5 million
# had not finished after 200 s. The longest technique name a bench has written is 114.
MAX_LABEL_CHARS = 160


def plain_label(text: Any) -> str:
    """``text`` as matplotlib shows it literally: a ``$`` would start mathtext (a name from a
    results file with an unbalanced one would fail the whole plot), and half a surrogate pair is
    written as its escape. At most MAX_LABEL_CHARS characters are kept: a longer name keeps its
    start and end around an ellipsis (the tables show it whole), so that names differing only at
    their end stay apart."""
    text = str(text)
    if len(text) > MAX_LABEL_CHARS:
        tail = MAX_LABEL_CHARS // 3
        text = f"{text[:MAX_LABEL_CHARS - tail - 1]}\u2026{text[-tail:]}"
    # Half a surrogate pair (a file name's undecodable byte as Python holds it, or a row's
    # "\ud800") is drawn as its escape, as report.md writes it: matplotlib's text layout takes
    # only real text, and refused the whole plot with a TypeError (exit 1).
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("$", r"\$")


def run_context(records: list[dict[str, Any]]) -> str:
    """The settings every plot title names: scale, batch x sequence, steps, max-batch budget."""
    def shared(key: str) -> Any:
        values = {r.get(key) for r in records if r.get(key) is not None}
        return values.pop() if len(values) == 1 else None

    parts = []
    if shared("scale"):
        parts.append(f"scale {plain_label(shared('scale'))}")
    if shared("batch_size") and shared("seq_len"):
        parts.append(f"batch {shared('batch_size')} x seq {shared('seq_len')}")
    if shared("steps"):
        parts.append(f"{shared('steps')} steps")
    budget = shared("max_batch_budget_bytes")
    if budget:
        parts.append(f"max-batch budget {budget / GIB:.2f} GiB")
    return "; ".join(parts)


def _title(title: str, records: list[dict[str, Any]]) -> str:
    context = run_context(records)
    return f"{title}\n{context}" if context else title


def plot_peak_memory(records: list[dict[str, Any]], path: Path) -> None:
    """Stacked horizontal bars: the tracked peak split by category, per technique."""
    plt = _plt()
    recs = _ok(records, "peak_tracked_bytes")
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(recs) + 2.2))
    names = [plain_label(r["technique"]) for r in recs]
    left = [0.0] * len(recs)
    for c in CATEGORIES:
        vals = [(r.get(f"{c}_bytes") or 0) / MIB for r in recs]
        ax.barh(names, vals, left=left, color=COLORS[c], label=c)
        left = [a + b for a, b in zip(left, vals)]
    for i, r in enumerate(recs):
        ax.text(left[i], i, f" {r['peak_tracked_bytes'] / MIB:,.0f} MiB", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("tracked peak memory (MiB), split by category at the peak")
    ax.set_title(_title("Peak memory per technique", records), fontsize=11)
    ax.set_xlim(0, max(left or [1]) * 1.22)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28 if len(recs) < 4 else -0.12), ncol=5, fontsize=8,
              frameon=False)
    fig.tight_layout()
    save_figure(fig, path)


def _bar(records: list[dict[str, Any]], key: str, label: str, title: str, path: Path,
         text: Callable[[dict[str, Any]], str]) -> None:
    """Horizontal bars of ``key`` per technique, each labelled ``text(record)``."""
    plt = _plt()
    recs = _ok(records, key)
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(recs) + 2.0))
    names = [plain_label(r["technique"]) for r in recs]
    vals = [r[key] for r in recs]
    ax.barh(names, vals, color="#4C72B0")
    for i, r in enumerate(recs):
        ax.text(r[key], i, " " + text(r), va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(label)
    ax.set_title(_title(title, records), fontsize=11)
    ax.set_xlim(0, max(vals or [1]) * 1.2)
    fig.tight_layout()
    save_figure(fig, path)


def plot_memory_vs_time(records: list[dict[str, Any]], path: Path, answers: bool = False) -> None:
    """Scatter: tracked peak (x) vs median step time (y), labelled with validation perplexity
    (``answers``: over the answer tokens only, --loss-on completion, which the title says).
    Down and left is better; the label says what it cost in quality."""
    plt = _plt()
    recs = [r for r in records if r.get("peak_tracked_bytes") is not None and r.get("step_time_s") is not None]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [r["peak_tracked_bytes"] / GIB for r in recs]
    ys = [r["step_time_s"] for r in recs]
    ax.scatter(xs, ys, s=60, color="#C44E52", zorder=3)
    ax.set_xlabel("tracked peak memory (GiB)")
    ax.set_ylabel("median step time (s)")
    what = "validation perplexity over answer tokens" if answers else "validation perplexity"
    ax.set_title(_title(f"Memory vs step time (label: {what})", records), fontsize=11)
    ax.grid(True, alpha=0.3)
    if xs:
        ax.set_xlim(0, max(xs) * 1.25)
        ax.set_ylim(0, max(ys) * 1.25)
    fig.tight_layout()
    labels = [f"{plain_label(r['technique'])}\n" + (f"ppl {r['val_ppl']:.0f}" if r.get("val_ppl") is not None else "ppl n/a")
              for r in recs]
    place_labels(ax, list(zip(xs, ys)), labels)
    save_figure(fig, path)


# Where a label may go, relative to its point: rings of growing radius (points), and on each
# ring the diagonals first (they keep the label clear of the marker), then the axes.
_RADII = (8, 26, 44, 62, 80, 98)
_ANGLES = (45, -45, 135, -135, 90, -90, 0, 180)


def place_labels(ax: Any, points: list[tuple[float, float]], labels: list[str], fontsize: int = 8) -> list[Any]:
    """Annotate each point without letting labels overlap one another, any marker or the axes'
    edge: a label takes the first free spot on rings around its point (with a leader line when
    it sits away from it); up and right of the point, overlapping, when no spot is free.

    Hand-written: matplotlib has no collision avoidance for annotations (adjustText does, with
    scipy as a dependency, for a task this small)."""

    # matplotlib loads only when a plot is drawn: the CLI's start-up imports this module
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    r = 6 * fig.dpi / 72  # marker radius in pixels (scatter s=60 is ~7.7 points wide)
    markers = [Bbox.from_extents(x - r, y - r, x + r, y + r) for x, y in ax.transData.transform(points)]
    taken: list[Any] = list(markers)
    placed = []
    for (x, y), text in zip(points, labels):
        chosen = None
        for radius in _RADII:
            for angle in _ANGLES:
                dx, dy = radius * math.cos(math.radians(angle)), radius * math.sin(math.radians(angle))
                ann = ax.annotate(
                    text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                    ha="left" if dx > 1 else "right" if dx < -1 else "center",
                    va="bottom" if dy > 1 else "top" if dy < -1 else "center",
                    arrowprops=dict(arrowstyle="-", color="0.55", lw=0.6, shrinkA=0, shrinkB=4) if radius > _RADII[0] else None,
                )
                ann.update_positions(renderer)
                box = Text.get_window_extent(ann, renderer).padded(2)
                inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                if inside and not any(box.overlaps(t) for t in taken):
                    chosen = (ann, box)
                    break
                ann.remove()
            if chosen:
                break
        if chosen is None:  # crowded beyond every ring: the plain spot, as before
            ann = ax.annotate(text, (x, y), xytext=(6, 4), textcoords="offset points", fontsize=fontsize)
            ann.update_positions(renderer)
            chosen = (ann, Text.get_window_extent(ann, renderer))
        taken.append(chosen[1])
        placed.append(chosen[0])
    return placed


def write_plots(records: list[dict[str, Any]], out: Path, answers: bool = False) -> list[Path]:
    """Write every plot that has data (the first MAX_PLOT_ROWS rows); return the paths written.
    ``answers``: the rows' perplexity is over answer tokens only (--loss-on completion)."""
    records = records[:MAX_PLOT_ROWS]
    written = []
    peak, step, batch, scatter = (out / name for name in PLOT_FILES)
    if _ok(records, "peak_tracked_bytes"):
        plot_peak_memory(records, peak)
        written.append(peak)
    if _ok(records, "step_time_s"):
        _bar(records, "step_time_s", "median step time (s)", "Step time per technique", step,
             lambda r: f"{r['step_time_s']:.3f} s")
        written.append(step)
    if _ok(records, "max_batch"):
        # "256+": the search reached its cap without running out of the budget (a lower bound).
        _bar(records, "max_batch", "largest batch whose training step fits the budget (N+: the search's cap)",
             "Max batch per technique", batch,
             lambda r: f"{r['max_batch']:.0f}" + ("+" if r.get("max_batch_capped") else ""))
        written.append(batch)
    if _ok(records, "step_time_s") and _ok(records, "peak_tracked_bytes"):
        plot_memory_vs_time(records, scatter, answers)
        written.append(scatter)
    return written
