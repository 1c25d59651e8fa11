"""Prometheus metrics with vLLM's names under the `dspark:` prefix, on a private registry.

Fed by the scheduler's worker thread (`StatsListener`): gauges, token counters and inter-token
latency after every step, the rest per request when it finishes. Counter semantics:

- prompt_tokens: a request's prompt once its first token is delivered (its prefill is done);
  generation_tokens: tokens as they are delivered, so rate() follows long streams as vLLM's does.
  Both are counted before the client sees those tokens, and add up to the responses' usage
  (each of a request's n choices is an engine request: its prompt counts n times here, once in
  the response's usage).
- spec_decode_num_drafts: target passes of decoding requests (one per request per step,
  whether or not the drafter proposed anything), so mean acceptance length
  1 + accepted / drafts matches vLLM's formula, and generation tokens / drafts ~ tau.
- spec_decode_num_draft_tokens: draft tokens the drafter proposed; ..._verified_tokens: the
  ones the policy sent to the target; ..._accepted_tokens: the ones the target kept.
- spec_decode_num_lookup_drafts / ..._lookup_accepted_tokens: the passes that verified a
  looked-up chain (the n-gram assist) instead of drafts, and the tokens kept from them (a part
  of the counters above).
- The spec_decode counters and request_success_total{finished_reason} are added when
  a request ends (aborted ones included, under finished_reason="abort"), from the same
  SpecStats a response reports under "speculation", so they always agree with the responses.
- inter_token_latency_seconds is observed once per generated token: a step that delivers n
  tokens to a request observes (time since its previous delivery) / n, n times.
- mean_acceptance_length and generation_tokens_per_second are gauges over a recent window.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark.scheduler.stats import FinishedRequest, RecentWindow, StepRecord

P = "dspark:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
        0.5, 0.75, 1.0, 2.5, 5.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
        480.0, 960.0)


class ServerMetrics:
    """All of one server's metrics; thread-safe, implements the scheduler's StatsListener."""

    def __init__(self, model_name: str, replica: str | None = None):
        self.registry = r = CollectorRegistry(auto_describe=True)
        # replica: one server of several behind one endpoint, so their series stay apart once summed
        labels = {"model_name": model_name} | ({"replica": replica} if replica else {})
        names, lv = list(labels), list(labels.values())

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(P + name, doc, names, registry=r).labels(*lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(P + name, doc, names, registry=r).labels(*lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, names, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means every page is in use.")
        self.ttft = hist("time_to_first_token_seconds", "Time to the first token.", _LATENCY)
        self.itl = hist("inter_token_latency_seconds", "Time per generated token after the first.", _ITL)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _E2E)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill finished.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens delivered to clients.")
        self.success = Counter(P + "request_success", "Finished requests by finish reason.",
                               names + ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.success.labels(*lv, reason)
        self.preemptions = counter("num_preemptions", "Requests preempted (and later recomputed).")
        self.prefix_queries = counter("prefix_cache_queries", "Tokens of admitted requests looked up in the "
                                      "prefix cache (--enable-prefix-caching).")
        self.prefix_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache (not computed again).")
        self.drafts = counter("spec_decode_num_drafts", "Target passes of decoding requests (drafts).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.verified_tokens = counter("spec_decode_num_verified_tokens",
                                       "Draft tokens the policy sent to the target for verification.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.lookup_drafts = counter("spec_decode_num_lookup_drafts",
                                     "Target passes that verified a looked-up chain (n-gram assist).")
        self.lookup_accepted = counter("spec_decode_num_lookup_accepted_tokens",
                                       "Looked-up (n-gram assist) tokens accepted.")
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the block.",
                                        names + ["position"], registry=r)
        self.mean_acceptance_length = gauge("spec_decode_mean_acceptance_length",
                                            "Tokens committed per target pass (tau) over a recent window.")
        self.tokens_per_s = gauge("generation_tokens_per_second", "Generated tokens/s over a recent window.")
        self._labels = lv
        self._seen = (0, 0, 0)  # engine totals already counted: preemptions, prefix queries, prefix hits

    def bind_window(self, window: RecentWindow) -> None:
        """Read tau and tokens/s from the scheduler's rolling window at scrape time."""
        self.mean_acceptance_length.set_function(window.tau)
        self.tokens_per_s.set_function(window.tokens_per_s)

    def set_baseline(self, num_preemptions: int, prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """Start the counters of engine totals from the engine's counts when this server attached."""
        self._seen = (num_preemptions, prefix_queries, prefix_hits)

    # StatsListener
    def on_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def on_step(self, record: StepRecord) -> None:
        self.running.set(record.running)
        self.waiting.set(record.waiting)
        self.kv_usage.set(record.kv_usage)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.new_tokens)
        totals = (record.num_preemptions, record.prefix_queries, record.prefix_hits)
        for counter, now, seen in zip((self.preemptions, self.prefix_queries, self.prefix_hits), totals, self._seen):
            if now > seen:
                counter.inc(now - seen)
        self._seen = tuple(max(a, b) for a, b in zip(totals, self._seen))
        for value, count in record.inter_token:
            for _ in range(count):
                self.itl.observe(value)

    def on_finish(self, req: FinishedRequest) -> None:
        self.success.labels(*self._labels, req.finish_reason).inc()
        if req.ttft is not None:
            self.ttft.observe(req.ttft)
        self.e2e.observe(req.e2e)
        s = req.stats
        self.drafts.inc(s.steps)
        self.draft_tokens.inc(s.proposed)
        self.verified_tokens.inc(s.verified)
        self.accepted_tokens.inc(s.accepted)
        self.lookup_drafts.inc(s.lookup_steps)
        self.lookup_accepted.inc(s.lookup_accepted)
        for pos, n in enumerate(s.accepted_per_pos):
            self.accepted_per_pos.labels(*self._labels, str(pos)).inc(n)

    def render(self) -> bytes:
        """The exposition text for GET /metrics."""
        return generate_latest(self.registry)
