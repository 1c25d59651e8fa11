"""The figures ``vllm bench serve`` reports, from the results of one benchmark run.

Key names follow vLLM's JSON (``completed``, ``request_throughput``, ``mean_ttft_ms``, ...).
Throughputs divide by the run's wall duration; latencies are over successful requests only.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from dspark.bench.client import RequestResult

PERCENTILES = (99,)


def percentile(values: list[float], pct: float) -> float:
    """The ``pct`` percentile with linear interpolation (numpy's default); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [1000 * s for s in seconds]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = percentile(ms, p)
    return {k: round(v, 3) for k, v in out.items()}


def summarize_run(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs and TTFT / TPOT / ITL / E2E latency statistics of one run."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error for r in results if not r.success)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": round(duration, 4),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 4) if duration > 0 else 0.0,
        "output_throughput": round(out_tokens / duration, 4) if duration > 0 else 0.0,
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 4) if duration > 0 else 0.0,
    }
    summary.update(_latency_stats("ttft", [r.ttft for r in ok]))
    summary.update(_latency_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    summary.update(_latency_stats("itl", [gap for r in ok for gap in r.itl]))
    summary.update(_latency_stats("e2el", [r.latency for r in ok]))
    summary["finish_reasons"] = dict(Counter(str(r.finish_reason) for r in ok))
    summary["errors"] = [{"error": e, "count": n} for e, n in errors.most_common(5)]
    return summary
