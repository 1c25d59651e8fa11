"""Issue 61's table from the JSON reports of `scripts/serve_vs_llamaserver.sh` run several times:
medians of the runs and run-by-run ratios, as markdown on stdout.

    .venv/bin/python scripts/serve_load_summary.py results/bench/twelfth/serve_load -run1 -run2 -run3
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from dspark.bench.plot import load_report

ROWS = {"defaults": "dspark-default", "none": "dspark-none", "llama-server": "llama-server"}


def load(folder: Path, tags: list[str]) -> dict[str, list[dict[int, dict]]]:
    """row -> per run, concurrency -> that level's report."""
    out = {}
    for row, stem in ROWS.items():
        runs = []
        for tag in tags:
            path = folder / f"{stem}{tag}.json"
            if path.exists():
                runs.append({r["concurrency"]: r for r in load_report(path)["runs"]})
        out[row] = runs
    return out


def main(folder: str, *tags: str) -> None:
    data = load(Path(folder), list(tags) or [""])
    levels = sorted(data["defaults"][0])
    med = statistics.median

    def col(row: str, key: str, c: int) -> list[float]:
        return [run[c][key] for run in data[row] if c in run]

    def ratios(a: str, b: str, key: str, c: int) -> list[float]:
        return [x / y for x, y in zip(col(a, key, c), col(b, key, c)) if y]

    lines = ["| | " + " | ".join(f"c={c}" for c in levels) + " |", "| --- |" + " ---: |" * len(levels)]

    def add(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    for row in ROWS:
        if data[row]:
            add(f"output tok/s, {row} (median of {len(data[row])})",
                [f"{med(col(row, 'output_throughput', c)):.1f}" for c in levels])
    for a, b in (("defaults", "none"), ("defaults", "llama-server")):
        if data[b]:
            add(f"{a} / {b}, run by run (median)",
                [", ".join(f"{r:.2f}" for r in ratios(a, b, "output_throughput", c))
                 + f" ({med(ratios(a, b, 'output_throughput', c)):.2f}x)" for c in levels])
    present = [r for r in ROWS if data[r]]
    for key, label in (("mean_ttft_ms", "mean TTFT ms"), ("p99_itl_ms", "P99 ITL ms")):
        add(f"{label}: {' / '.join(present)} (medians)",
            [" / ".join(f"{med(col(r, key, c)):,.0f}" for r in present) for c in levels])
        if data["llama-server"]:
            add(f"{label}, defaults / llama-server, run by run (median)",
                [", ".join(f"{r:.2f}" for r in ratios("defaults", "llama-server", key, c))
                 + f" ({med(ratios('defaults', 'llama-server', key, c)):.2f}x)" for c in levels])
    add("tau, defaults (runs)", [", ".join(f"{t:.2f}" for t in col("defaults", "tau", c)) for c in levels])
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
