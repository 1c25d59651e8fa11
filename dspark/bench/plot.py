"""Plots of `dspark bench serve` reports: output throughput and TTFT against concurrency, one line
per report (labelled by its ``label``). matplotlib is optional (``pip install 'dspark[plot]'``)."""

from __future__ import annotations

import json
import pathlib
from typing import Any


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'dspark[plot]' "
                              "(in this repository: .venv/bin/pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_report(path: str | pathlib.Path) -> dict[str, Any]:
    """A saved `dspark bench serve` JSON report; its label defaults to the file name."""
    path = pathlib.Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list) or not report["runs"]:
        raise ValueError(f"{path} is not a `dspark bench serve` report (no 'runs')")
    report["label"] = report.get("label") or path.stem
    return report


def unique_labels(reports: list[dict[str, Any]]) -> list[str]:
    """The reports' labels, numbered where two are the same."""
    labels = [str(r.get("label") or f"run {i + 1}") for i, r in enumerate(reports)]
    return [f"{lab} ({labels[:i].count(lab) + 1})" if labels.count(lab) > 1 else lab
            for i, lab in enumerate(labels)]


def x_axis(runs: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """Concurrency on x (unbounded = the number of requests), or the request rate when only it varies."""
    conc = [r.get("concurrency") or r.get("num_prompts") or 0 for r in runs]
    rates = [r.get("request_rate") for r in runs]
    if len(set(conc)) == 1 and len(set(rates)) > 1 and None not in rates:
        return "request rate (req/s)", [float(x) for x in rates]
    return "concurrency", [float(x) for x in conc]


def plot_reports(reports: list[dict[str, Any]], output: str | pathlib.Path, title: str | None = None) -> None:
    """Draw output throughput and mean TTFT against load, a line per report, into ``output`` (PNG, SVG...)."""
    plt = _pyplot()
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    xlabel = "concurrency"
    for report, label in zip(reports, unique_labels(reports)):
        xlabel, xs = x_axis(report["runs"])  # decided over all runs: one run alone always reads as concurrency
        order = sorted(range(len(xs)), key=xs.__getitem__)
        runs, xs = [report["runs"][i] for i in order], [xs[i] for i in order]
        ax_tp.plot(xs, [r.get("output_throughput") for r in runs], marker="o", label=label)
        ax_ttft.plot(xs, [r.get("mean_ttft_ms") for r in runs], marker="o", label=label)
    for ax, ylabel in ((ax_tp, "output throughput (tok/s)"), (ax_ttft, "mean TTFT (ms)")):
        xs_all = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata()})
        if xs_all and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 4:
            ax.set_xscale("log", base=2)
        if 0 < len(xs_all) <= 12:  # a tick at each measured load, written plainly
            ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
            ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title or "dspark bench serve")
    fig.tight_layout()
    pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)
