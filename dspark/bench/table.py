"""The serving benchmark's figures as an aligned text table: one row per figure, one column per run."""

from __future__ import annotations

from typing import Any

# (row title, key in a run's summary, number of decimals); a None key starts a section
ROWS: list[tuple[str, str | None, int]] = [
    ("Successful requests", "completed", 0),
    ("Failed requests", "failed", 0),
    ("Benchmark duration (s)", "duration", 2),
    ("Total input tokens", "total_input_tokens", 0),
    ("Total generated tokens", "total_output_tokens", 0),
    ("Request throughput (req/s)", "request_throughput", 2),
    ("Output token throughput (tok/s)", "output_throughput", 2),
    ("Total token throughput (tok/s)", "total_token_throughput", 2),
    ("Time to First Token", None, 0),
    ("Mean TTFT (ms)", "mean_ttft_ms", 2),
    ("Median TTFT (ms)", "median_ttft_ms", 2),
    ("P99 TTFT (ms)", "p99_ttft_ms", 2),
    ("Time per Output Token (excl. 1st token)", None, 0),
    ("Mean TPOT (ms)", "mean_tpot_ms", 2),
    ("Median TPOT (ms)", "median_tpot_ms", 2),
    ("P99 TPOT (ms)", "p99_tpot_ms", 2),
    ("Inter-token Latency (per chunk)", None, 0),
    ("Mean ITL (ms)", "mean_itl_ms", 2),
    ("Median ITL (ms)", "median_itl_ms", 2),
    ("P99 ITL (ms)", "p99_itl_ms", 2),
    ("Speculative Decoding (server /metrics)", None, 0),
    ("Tau (tokens per target pass)", "tau", 3),
    ("Acceptance rate", "acceptance_rate", 3),
    ("Drafts (target passes)", "spec_drafts", 0),
    ("Accepted draft tokens", "spec_accepted_tokens", 0),
]


def run_title(run: dict[str, Any]) -> str:
    """A column heading: the run's concurrency, and its request rate when one was set."""
    conc = run.get("concurrency")
    title = f"c={conc if conc is not None else 'max'}"
    if run.get("request_rate") is not None:
        title += f" r={run['request_rate']:g}"
    return title


def _cell(value: Any, decimals: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:,.{decimals}f}" if decimals else f"{round(value):,d}"
    return str(value)


def format_table(runs: list[dict[str, Any]], title: str = "Serving Benchmark Result") -> str:
    """The runs side by side, vLLM's figures as rows, right-aligned numbers."""
    heads = [run_title(r) for r in runs]
    label_w = max(len(name) for name, key, _ in ROWS if key is not None)
    cells = [[_cell(r.get(key), dec) for r in runs] if key is not None else [] for _, key, dec in ROWS]
    col_w = [max([len(h)] + [len(row[i]) for row in cells if row]) for i, h in enumerate(heads)]
    titles = [title] + [name for name, key, _ in ROWS if key is None]
    width = max(label_w + sum(w + 2 for w in col_w), max(len(t) + 4 for t in titles))
    label_w = width - sum(w + 2 for w in col_w)
    lines = [f" {title} ".center(width, "="),
             "".ljust(label_w) + "".join(h.rjust(w + 2) for h, w in zip(heads, col_w))]
    for (name, key, _), row in zip(ROWS, cells):
        if key is None:
            lines.append(f" {name} ".center(width, "-"))
        else:
            lines.append(name.ljust(label_w) + "".join(c.rjust(w + 2) for c, w in zip(row, col_w)))
    lines.append("=" * width)
    return "\n".join(lines)
