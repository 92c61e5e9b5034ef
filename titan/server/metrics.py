"""Prometheus metrics under vLLM's names with the `titan:` prefix, one `model_name` label.

Two writers, each cheap: the engine thread records per-step figures (gauges, counters read from the
engine's stats, step time, tokens per step); the event loop records per-request figures when it hands
outputs to their streams (TTFT, inter-token latency, end-to-end and phase times, token counts).
Buckets are fine around the values that matter on this hardware: 1 ms steps up to 10 ms for ITLs,
~20 ms steps around 100 ms for TTFTs.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from titan.engine.llm_engine import EngineStats
from titan.engine.outputs import RequestOutput
from titan.engine.spec.planner import SpecStats

PREFIX = "titan:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.11, 0.125, 0.15,
                0.175, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0)
ITL_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.0125, 0.015, 0.0175,
               0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)
REQUEST_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                        5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count histograms)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for step in (1, 2, 5):
            value = step * scale
            if value > limit:
                return buckets
            buckets.append(value)
        scale *= 10


def power_of_two_buckets(limit: int) -> list[float]:
    buckets = [1.0]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return buckets


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float] | tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.startup_seconds = gauge("startup_seconds", "Cold start: process start until ready to serve.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prefilled prompt tokens (counted at first token).")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions_total", "Preemptions of running requests.")
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits_total", "Tokens found in the prefix cache.")
        self._success = Counter(PREFIX + "request_success_total", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.success = {reason: self._success.labels(model_name, reason) for reason in ("stop", "length", "abort")}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_TIME_BUCKETS)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          power_of_two_buckets(max_num_batched_tokens))
        self.step_seconds = histogram("engine_step_seconds", "Wall time of one engine step.", ITL_BUCKETS)
        self.gc_pause = Histogram(PREFIX + "gc_pause_seconds", "Garbage-collector pauses, by generation.",
                                  ["model_name", "generation"], buckets=ITL_BUCKETS, registry=self.registry)
        self._model_name = model_name
        self.admission_rejections = Counter(PREFIX + "admission_rejections_total",
                                            "Requests refused by admission control (HTTP 429), by reason.",
                                            ["model_name", "reason"], registry=self.registry)
        self.degradations = Counter(PREFIX + "degraded_requests_total",
                                    "Requests degraded under pressure (e.g. max_tokens clamped), by kind.",
                                    ["model_name", "kind"], registry=self.registry)
        # Speculative decoding (vLLM's names); they appear once speculation is configured.
        self.spec_drafts = counter("spec_decode_num_drafts_total", "Verifications: sequence-steps that carried drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens_total", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self._spec_per_position = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos_total",
                                          "Draft tokens accepted, by position in the draft (0 = first).",
                                          ["model_name", "position"], registry=self.registry)
        self._last_stats: EngineStats | None = None

    # ---- engine thread -------------------------------------------------------------------------
    def record_admission_rejection(self, reason: str) -> None:
        self.admission_rejections.labels(self._model_name, reason).inc()

    def record_degradation(self, kind: str) -> None:
        self.degradations.labels(self._model_name, kind).inc()

    def record_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(self._model_name, str(generation)).observe(seconds)

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges from a fresh snapshot; counters advance by the engine's deltas since the last one."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        last = self._last_stats
        for counter, now, before in (
            (self.num_preemptions, stats.num_preemptions, last.num_preemptions if last else 0),
            (self.prefix_cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries if last else 0),
            (self.prefix_cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits if last else 0),
        ):
            if now > before:
                counter.inc(now - before)
        if stats.spec is not None:
            self._record_spec(stats.spec, last.spec if last else None)
        self._last_stats = stats

    def _record_spec(self, spec: SpecStats, last: SpecStats | None) -> None:
        for counter, now, before in (
            (self.spec_drafts, spec.num_drafts, last.num_drafts if last else 0),
            (self.spec_draft_tokens, spec.num_draft_tokens, last.num_draft_tokens if last else 0),
            (self.spec_accepted_tokens, spec.num_accepted_tokens, last.num_accepted_tokens if last else 0),
        ):
            if now > before:
                counter.inc(now - before)
        for position, count in enumerate(spec.accepted_per_position):
            before = last.accepted_per_position[position] if last else 0
            series = self._spec_per_position.labels(self._model_name, str(position))
            if count > before or last is None:
                series.inc(count - before)

    def record_step(self, seconds: float, num_tokens: int) -> None:
        self.step_seconds.observe(seconds)
        if num_tokens > 0:
            self.iteration_tokens.observe(num_tokens)

    # ---- event loop ----------------------------------------------------------------------------
    def record_output(self, output: RequestOutput, previous_token_time: float | None, now: float) -> None:
        """One output of one request; `previous_token_time` is when its last token arrived (None: none yet)."""
        num_new = len(output.new_token_ids)
        if num_new:
            self.generation_tokens.inc(num_new)
            if previous_token_time is None:
                self.prompt_tokens.inc(output.num_prompt_tokens)
                arrival, first_token = output.metrics.get("arrival"), output.metrics.get("first_token")
                if arrival is not None and first_token is not None:
                    self.ttft.observe(first_token - arrival)
            else:
                self.itl.observe(now - previous_token_time)
        if output.finished:
            self.record_finished(output)

    def record_finished(self, output: RequestOutput) -> None:
        stamps = output.metrics
        arrival = stamps.get("arrival")
        scheduled = stamps.get("first_scheduled")
        first_token = stamps.get("first_token")
        finished = stamps.get("finished")
        if output.finish_reason in self.success:
            self.success[output.finish_reason].inc()
        if arrival is not None and finished is not None:
            self.e2e.observe(finished - arrival)
        if arrival is not None and scheduled is not None:
            self.queue_time.observe(scheduled - arrival)
        if scheduled is not None and first_token is not None:
            self.prefill_time.observe(first_token - scheduled)
        if first_token is not None and finished is not None:
            self.decode_time.observe(finished - first_token)
        self.request_prompt_tokens.observe(output.num_prompt_tokens)
        self.request_generation_tokens.observe(output.num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
