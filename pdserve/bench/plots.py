"""PNG plots of a benchmark (matplotlib, Agg backend; imported only when plots are asked for).

- attainment_vs_rate.png: TTFT, TPOT and joint attainment against offered rate, the target p as
  a horizontal line, and both goodput points marked;
- ttft_cdf.png, tpot_cdf.png: empirical CDFs over successful requests with the SLO threshold.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.bench.goodput import GoodputResult  # noqa: E402
from pdserve.bench.metrics import Attainment, Slo  # noqa: E402
from pdserve.bench.records import RequestRecord  # noqa: E402


def write_plots(
    out_dir: str | Path,
    points: dict[float, Attainment],
    records: tuple[RequestRecord, ...],
    slo: Slo,
    goodput: dict[str, GoodputResult] | None = None,
) -> list[Path]:
    """Write all plots into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_attainment(out / "attainment_vs_rate.png", points, slo.attainment, goodput)]
    ok = [r for r in records if r.success]
    paths.append(plot_cdf(out / "ttft_cdf.png", [r.ttft_s for r in ok if r.ttft_s is not None], slo.ttft_s, "TTFT"))
    paths.append(plot_cdf(out / "tpot_cdf.png", [r.tpot_s for r in ok if r.tpot_s is not None], slo.tpot_s, "TPOT"))
    return paths


def plot_attainment(path: Path, points: dict[float, Attainment], target: float, goodput=None) -> Path:
    """Attainment vs offered rate with the target and goodput points."""
    rates = sorted(points)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("ttft", "tpot", "joint"):
        ax.plot(rates, [getattr(points[r], name) for r in rates], marker="o", label=f"{name} attainment")
    ax.axhline(target, color="grey", linestyle="--", label=f"target p={target:g}")
    marks = {"joint": dict(marker="*", color="red", markersize=14), "phase": dict(marker="D", color="black", fillstyle="none", markersize=10)}
    for definition, style in marks.items():
        if goodput and goodput[definition].rate > 0:
            rate = goodput[definition].rate
            ax.axvline(rate, color=style["color"], linestyle=":", linewidth=1)
            ax.plot([rate], [target], linestyle="none", zorder=5, label=f"{definition} goodput {rate:.3g} req/s", **style)
    ax.set(xlabel="offered rate (req/s)", ylabel="attainment", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_cdf(path: Path, values_s: list[float], slo_s: float, name: str) -> Path:
    """Empirical CDF of `values_s` (shown in ms) with the SLO threshold."""
    fig, ax = plt.subplots(figsize=(6, 4))
    if values_s:
        xs = np.sort(np.asarray(values_s)) * 1e3
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{name} CDF")
    ax.axvline(slo_s * 1e3, color="red", linestyle="--", label=f"SLO {slo_s * 1e3:g} ms")
    ax.set(xlabel=f"{name} (ms)", ylabel="fraction of successful requests", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
