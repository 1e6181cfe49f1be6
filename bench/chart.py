"""The suite's chart: every ratio the sections report, one horizontal bar each, with a line at 1x.

matplotlib is optional (the `bench` extra); without it the suite still writes its tables.

    python -m bench.chart bench/results.json   # redraw bench/results.png from the suite's numbers
"""

import json
import sys
from pathlib import Path


def draw(ratios: dict[str, tuple[float, float | None]], path: Path, subtitle: str) -> bool:
    """Write a PNG of label -> (ratio, goal or None), higher is better for pagedchat; bars are green
    where the goal is met, red where it is missed, grey without a goal. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display here
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        return False
    labels = list(ratios)[::-1]  # first entry on top
    values = [ratios[label][0] for label in labels]
    goals = [ratios[label][1] for label in labels]
    colours = ["#8d99ae" if g is None else "#2a9d8f" if v >= g else "#e76f51" for v, g in zip(values, goals)]
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(labels) + 1.8))
    ax.barh(labels, values, color=colours)
    for y, (v, g) in enumerate(zip(values, goals)):
        if g is not None:
            ax.plot([g, g], [y - 0.42, y + 0.42], color="black", linewidth=2)
        ax.text(max(v, g or 0) * 1.04, y, f"{v:.2f}x" + (f"  (goal {g:g}x)" if g else ""), va="center", fontsize=9)
    ax.axvline(1.0, color="#444444", linewidth=1, linestyle=":")
    ax.set_xscale("log")
    low, high = min(0.5, min(values) * 0.8), max(max(values), *(g for g in goals if g)) * 2.2
    ax.set_xlim(low, high)
    ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32) if low <= t <= high]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}x" for t in ticks])
    ax.set_xlabel("in pagedchat's favour: peer time / pagedchat's, or a capacity ratio (log scale)")
    ax.set_title(f"pagedchat benchmarks -- {subtitle}\nblack mark: goal; green: met, red: missed, grey: no goal",
                 fontsize=10, loc="right")
    ax.tick_params(axis="y", labelsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("results.json"))
    data = json.loads(source.read_text())
    draw({k: tuple(v) for k, v in data["ratios"].items()}, source.with_suffix(".png"), data["subtitle"])
