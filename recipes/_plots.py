"""Figures the recipes write beside their numbers (matplotlib, Agg backend, PNG).

Each function takes plain data (lists / arrays / the report dict) and a destination path; the format
is always PNG, whatever the path's suffix (``commit_files`` hands writers ``*.tmp`` paths).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["plot_rank_load", "plot_plan", "plot_curves", "plot_bench", "pyplot", "save_png"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | os.PathLike) -> None:
    """Lay out ``fig``, write it to ``path`` as PNG (whatever the suffix) and close it (a failed save too:
    the run goes on without the plot)."""
    try:
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        pyplot().close(fig)


def plot_rank_load(rank_load: list[list[int]], path: str | os.PathLike, title: str) -> None:
    """Line plot of activations received per rank per step (``rank_load [steps][R]``); with no step,
    empty axes that say so."""
    plt = pyplot()
    data = np.asarray(rank_load, dtype=np.float64)
    data = data.reshape(len(data), -1) if data.size else np.zeros((0, 0))  # reshape(0, -1) is ambiguous
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    if not data.size:
        ax.text(0.5, 0.5, "no steps ran", ha="center", va="center", transform=ax.transAxes)
    for r in range(data.shape[1]):
        ax.plot(np.arange(data.shape[0]), data[:, r], lw=1, label=f"rank {r}")
    ax.set_xlabel("step")
    ax.set_ylabel("activations received")
    ax.set_title(title)
    if 0 < data.shape[1] <= 16:
        ax.legend(fontsize=7, ncol=min(8, data.shape[1]))
    save_png(fig, path)


def plot_plan(report: dict, path: str | os.PathLike) -> None:
    """``recipes/plan.py``'s picture of a run, per layer on the held-out part.

    Left: local activation rate of the chosen planner's assignment and of linear placement with the
    tokens spread evenly (``lar_per_layer``, ``lar_linear_per_layer``). Right: GEM step-latency score
    of every planned placement relative to linear (``per_layer``; below 0 = faster than linear).

    Args:
        report: the run's ``report.json`` content.
        path: destination (PNG).
    """
    plt = pyplot()
    fig, (ax_lar, ax_gem) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    layers = np.arange(len(report["lar_per_layer"]))
    ax_lar.plot(layers, report["lar_per_layer"], marker="o", ms=3, lw=1.2,
                label=f"{report['planner']} (mean {report['lar']:.3f})")
    ax_lar.plot(layers, report["lar_linear_per_layer"], marker="o", ms=3, lw=1.2, color="grey",
                label=f"linear, even tokens (mean {report['lar_linear']:.3f})")
    ax_lar.set(xlabel="layer", ylabel="local activation rate", ylim=(0, 1),
               title=f"held-out LAR, EP{report['ep']} mode={report['mode']}")
    ax_lar.legend(fontsize=8)
    per_layer = {k: np.asarray(v, dtype=np.float64) for k, v in report["per_layer"].items()}
    base = np.maximum(per_layer["linear"], 1e-300)
    for name, scores in per_layer.items():
        if name == "linear":
            continue
        total = 100.0 * (scores.sum() / base.sum() - 1.0)
        ax_gem.plot(layers, 100.0 * (scores / base - 1.0), marker="o", ms=3, lw=1.2,
                    label=f"{name} (all layers {total:+.2f} %)")
    ax_gem.axhline(0.0, color="grey", lw=1)
    ax_gem.set(xlabel="layer", ylabel="score vs linear (%)",
               title=f"held-out step latency (GEM score), variability={report['variability']}")
    ax_gem.legend(fontsize=8)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_lar, ax_gem):  # layers are whole numbers (2 layers showed ticks 0.2, 0.4, ...)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    save_png(fig, path)


def plot_curves(rows, latency_s: np.ndarray, raw_latency_s: np.ndarray, device_names,
                path: str | os.PathLike) -> None:
    """``recipes/profile.py``'s picture: each rank's latency curve and its spread from the fastest.

    Left: the non-decreasing fit (lines) over the raw measurements (dots), in microseconds. Right:
    each rank's fitted latency divided by the fastest rank's at the same row count.

    Args:
        rows: ``[N]`` sampled row counts.
        latency_s: ``[R, N]`` fitted seconds.
        raw_latency_s: ``[R, N]`` measured seconds.
        device_names: ``[R]`` device names (legend).
        path: destination (PNG).
    """
    plt = pyplot()
    x = np.asarray(rows, dtype=np.float64)
    lat, raw = np.asarray(latency_s, dtype=np.float64), np.asarray(raw_latency_s, dtype=np.float64)
    fig, (ax_lat, ax_sp) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    fastest = lat.min(axis=0)
    for r in range(lat.shape[0]):
        line, = ax_lat.plot(x, lat[r] * 1e6, lw=1.2, label=f"rank {r} ({device_names[r]})")
        ax_lat.plot(x, raw[r] * 1e6, ".", ms=3, color=line.get_color())
        ax_sp.plot(x, lat[r] / fastest, lw=1.2, color=line.get_color(), label=f"rank {r}")
    ax_lat.set(xlabel="rows per step", ylabel="latency (us)", title="grouped-expert latency (dots: measured)")
    ax_sp.set(xlabel="rows per step", ylabel="latency / fastest rank", title="spread between ranks")
    for ax in (ax_lat, ax_sp):
        ax.set_xscale("symlog", linthresh=128)
        if lat.shape[0] <= 16:
            ax.legend(fontsize=7)
    save_png(fig, path)


def plot_bench(records: list[dict], path: str | os.PathLike) -> None:
    """``recipes/bench.py``'s picture: milliseconds per forward (or training step) against tokens per
    rank for our layer, megatron's (the peer) and the baseline layer where timed (left), and our
    time divided by theirs (right; below 1: ours is faster).

    Args:
        records: the run's records (``tokens_per_rank``, ``ms``, ``peer_ms``, ``baseline_ms``, ...).
        path: destination (PNG).
    """
    plt = pyplot()
    recs = sorted(records, key=lambda r: r["tokens_per_rank"])
    x = np.asarray([r["tokens_per_rank"] for r in recs], dtype=np.float64)
    r0 = recs[0]
    sides = [("ours: " + str(r0["layer"]), "ms", None),
             (f"peer: {r0.get('peer') or 'megatron'}", "peer_ms", "ratio"),
             (f"baseline: {r0.get('baseline')}", "baseline_ms", "vs_baseline")]
    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    for label, key, ratio in sides:
        y = np.asarray([np.nan if r.get(key) is None else r[key] for r in recs], dtype=np.float64)
        if np.isnan(y).all():
            continue
        line, = ax_ms.plot(x, y, "o-", lw=1.2, label=label)
        if ratio is not None:
            ax_ratio.plot(x, [np.nan if r.get(ratio) is None else r[ratio] for r in recs], "o-", lw=1.2,
                          color=line.get_color(), label=f"ours / {label.split(': ', 1)[1]}")
    what = "training step (forward + backward)" if r0.get("train") else "forward"
    ax_ms.set(xlabel="tokens per rank", ylabel="ms per training step" if r0.get("train") else "ms per forward",
              ylim=(0, None),
              title=f"{r0['shape_name']}, {r0.get('mode') or 'eager'}: median, max over ranks")
    ax_ratio.axhline(1.0, color="grey", lw=1)
    ax_ratio.set(xlabel="tokens per rank", ylabel="time ratio", ylim=(0, None),
                 title="ours / theirs (below 1: ours is faster)")
    if not ax_ratio.lines[1:]:
        ax_ratio.text(0.5, 0.5, "no peer or baseline timed", ha="center", va="center", transform=ax_ratio.transAxes)
    for ax in (ax_ms, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(int(v)) for v in x])
        ax.minorticks_off()
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"bench: {r0['device_name']}, world {r0['world_size']} (ep {r0['ep']}), {r0['dtype']}, "
                 f"{what}", fontsize=10)
    save_png(fig, path)
