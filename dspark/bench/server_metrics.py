"""The server's speculative-decoding counters from ``/metrics``, and tau from their difference.

The counters are named as in :mod:`dspark.server.metrics` (vLLM's names under ``dspark:``; a vLLM
server's ``vllm:`` names are read too). The server adds a request's counts when it finishes, before
its last chunk is sent, so a scrape after every benchmark request ended sees all of them.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("dspark:", "vllm:")
COUNTERS = {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
            "verified_tokens": "spec_decode_num_verified_tokens_total",
            "accepted_tokens": "spec_decode_num_accepted_tokens_total",
            "generation_tokens": "generation_tokens_total"}


def parse_counters(text: str) -> dict[str, float]:
    """{short name: value summed over labels} of the COUNTERS present in an exposition text."""
    wanted = {prefix + name: short for short, name in COUNTERS.items() for prefix in PREFIXES}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            short = wanted.get(sample.name)
            if short is not None:
                out[short] = out.get(short, 0.0) + sample.value
    return out


async def scrape_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """GET ``base_url``/metrics and parse it; None when the server has no usable /metrics."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_counters(resp.text)
    except ValueError:
        return None


def spec_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Counter differences over a run, with ``tau`` = 1 + accepted / drafts (tokens per target pass)
    and ``acceptance_rate`` = accepted / verified draft tokens; None where not measurable."""
    keys = ("drafts", "draft_tokens", "verified_tokens", "accepted_tokens")
    out: dict[str, float | None] = {f"spec_{k}": None for k in keys}
    out.update(tau=None, acceptance_rate=None)
    if not before or not after:
        return out
    diff = {k: after[k] - before.get(k, 0.0) for k in keys if k in after}
    for k, v in diff.items():
        out[f"spec_{k}"] = int(v)
    drafts, accepted = diff.get("drafts"), diff.get("accepted_tokens")
    if drafts and accepted is not None:
        out["tau"] = round(1 + accepted / drafts, 4)
    verified = diff.get("verified_tokens", diff.get("draft_tokens"))
    if verified and accepted is not None:
        out["acceptance_rate"] = round(accepted / verified, 4)
    return out
