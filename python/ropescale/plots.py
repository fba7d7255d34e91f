"""PNG figures for the ``ropescale`` command and the demo (matplotlib, Agg backend, no display).

Every function writes one PNG of exactly ``size`` pixels (width, height) and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import torch

__all__ = ["DEFAULT_SIZE", "wavelengths", "decay", "feature_gap", "accuracy_by_position", "ruler_scores"]

DEFAULT_SIZE = (960, 540)
_DPI = 100


def _figure(size: tuple[int, int]):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    # A bare Figure (no pyplot) keeps no global state and needs no display.
    return Figure(figsize=(size[0] / _DPI, size[1] / _DPI), dpi=_DPI)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=_DPI)  # no bbox_inches="tight": keep the exact size
    return path


def wavelengths(
    tables: Mapping[str, torch.Tensor],
    path: str | Path,
    original_max_position: int | None = None,
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """Wavelength ``2*pi/theta_i`` against pair index for several methods on one log-scale plot,
    with the original context length as a horizontal line."""
    fig = _figure(size)
    ax = fig.add_subplot()
    styles = ["-", "--", "-.", ":"]
    for n, (name, inv_freq) in enumerate(tables.items()):
        wl = (2 * math.pi / inv_freq.double()).tolist()
        # Methods often coincide on many pairs: line styles keep every one visible.
        ax.plot(range(len(wl)), wl, linestyle=styles[n % len(styles)], marker=".", label=name)
    if original_max_position:
        ax.axhline(original_max_position, color="gray", linestyle="--", label=f"L = {original_max_position}")
    ax.set_yscale("log")
    ax.set_xlabel("pair index i")
    ax.set_ylabel("wavelength 2π/θ_i (tokens)")
    ax.set_title("RoPE wavelength per dimension")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def decay(
    curve: torch.Tensor,
    path: str | Path,
    first_negative: int | None = None,
    title: str = "",
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """The similarity-decay curve ``B_m`` against distance ``m``, with the first negative distance
    marked (Men et al.: the effective context ends just before it)."""
    fig = _figure(size)
    ax = fig.add_subplot()
    values = curve.double().tolist()
    ax.plot(range(len(values)), values, linewidth=0.8, label="B_m")
    ax.axhline(0.0, color="gray", linewidth=0.8)
    if first_negative is not None:
        ax.axvline(first_negative, color="red", linestyle="--", label=f"first B_m < 0 at m = {first_negative}")
        ax.plot([first_negative], [values[first_negative]], "ro")
    if len(values) > 1000:
        ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("relative distance m")
    ax.set_ylabel("B_m = Σ_i cos(m θ_i)")
    ax.set_title(title or "Similarity decay (Men et al.)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def feature_gap(
    gaps: Mapping[str, torch.Tensor],
    path: str | Path,
    critical_index: int | None = None,
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """Resonance feature gap per pair index for several tables (grouped bars), with the first
    post-critical pair marked."""
    fig = _figure(size)
    ax = fig.add_subplot()
    names = list(gaps)
    width = 0.8 / max(len(names), 1)
    for n, name in enumerate(names):
        values = gaps[name].double().tolist()
        ax.bar([i + (n - (len(names) - 1) / 2) * width for i in range(len(values))], values, width, label=name)
    if critical_index is not None:
        ax.axvline(critical_index - 0.5, color="gray", linestyle="--", label="wavelength ≥ L from here")
    ax.set_xlabel("pair index i")
    ax.set_ylabel("feature gap")
    ax.set_title("Resonance feature gap per dimension (test positions vs. training positions)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def accuracy_by_position(
    curves: Mapping[str, torch.Tensor],
    path: str | Path,
    train_length: int,
    first_position: int = 0,
    smooth: int = 1,
    title: str = "",
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """Accuracy against token position for several methods, the training length marked. NaN
    entries (positions that are not scored) are skipped; ``smooth`` > 1 averages that many positions."""
    fig = _figure(size)
    ax = fig.add_subplot()
    for name, acc in curves.items():
        acc = acc.double()
        positions = torch.arange(len(acc), dtype=torch.float64)
        keep = ~torch.isnan(acc)
        positions, acc = positions[keep], acc[keep]
        if smooth > 1 and len(acc) >= smooth:
            kernel = torch.ones(1, 1, smooth, dtype=torch.float64) / smooth
            acc = torch.nn.functional.conv1d(acc[None, None], kernel)[0, 0]
            positions = positions[smooth // 2 : smooth // 2 + len(acc)]
        ax.plot(positions.tolist(), (100 * acc).tolist(), label=name, linewidth=1.2)
    ax.axvline(train_length - 0.5, color="gray", linestyle="--", label=f"training length {train_length}")
    ax.set_ylim(-2, 102)
    ax.set_xlim(first_position, None)
    ax.set_xlabel("token position")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title or "Train short, test long")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ruler_scores(
    scores: Mapping[str, Mapping[int, float]],
    path: str | Path,
    threshold: float | None = None,
    effective_length: int | None = None,
    title: str = "",
    size: tuple[int, int] = DEFAULT_SIZE,
) -> Path:
    """RULER scores (0-100) against the context length (log 2 axis): a line per task, their average in bold,
    the threshold a length must pass and the effective length marked."""
    fig = _figure(size)
    ax = fig.add_subplot()
    lengths = sorted({n for by_length in scores.values() for n in by_length})
    styles = ["-", "--", "-.", ":"]
    for n, (task, by_length) in enumerate(scores.items()):
        xs = [x for x in lengths if x in by_length]
        ax.plot(xs, [by_length[x] for x in xs], linestyle=styles[n % len(styles)], marker="o", linewidth=1.0,
                alpha=0.8, label=task)
    if scores:
        average = [sum(by[x] for by in scores.values() if x in by) / sum(x in by for by in scores.values())
                   for x in lengths]
        ax.plot(lengths, average, color="black", marker="s", linewidth=2.5, label="average")
    if threshold is not None:
        ax.axhline(threshold, color="gray", linestyle="--", label=f"threshold {threshold:g}")
    if effective_length is not None:
        ax.axvline(effective_length, color="red", linestyle=":", label=f"effective length {effective_length}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([str(x) for x in lengths])
    ax.set_ylim(-2, 102)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("score (string_match_all, %)")
    ax.set_title(title or "RULER")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)
