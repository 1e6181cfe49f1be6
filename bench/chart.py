"""The suite's chart: every ratio the sections report, one horizontal bar each, with a line at 1x.

matplotlib is optional (the `bench` extra); without it the suite still writes its tables.
"""

from pathlib import Path


def draw(ratios: dict[str, float], path: Path, subtitle: str) -> bool:
    """Write a PNG of label -> ratio (higher is better for pagedchat); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display here
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels, values = list(ratios)[::-1], list(ratios.values())[::-1]  # first entry on top
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(labels) + 1.6))
    colours = ["#2a9d8f" if v >= 1 else "#e76f51" for v in values]
    bars = ax.barh(labels, values, color=colours)
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], padding=3, fontsize=9)
    ax.axvline(1.0, color="#444444", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(min(0.5, min(values) * 0.8), max(values) * 1.6)
    ax.set_xlabel("ratio in pagedchat's favour (peer time / pagedchat time, or pagedchat / peer capacity); log scale")
    ax.set_title("pagedchat benchmarks\n" + subtitle, fontsize=10)
    ax.tick_params(axis="y", labelsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
