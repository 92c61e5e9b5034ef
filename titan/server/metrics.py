"""Prometheus metrics under vLLM's names with the `titan:` prefix, one `model_name` label.

`--metrics-prefix vllm` exposes the metrics whose meaning matches vLLM's under `vllm:`, with vLLM's
labels (`model_name`, `engine`) and its admission-rejection counter (`num_requests_rejected_total`),
so dashboards, autoscaler triggers and gateways written for vLLM read Titan unchanged; the metrics
vLLM has no counterpart for keep `titan:` in both modes.

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
from titan.server.limits import METRICS_PREFIXES

PREFIX = "titan:"
# Titan-only metrics: the same name under either prefix setting (the router and the dashboard read them).
TITAN_ONLY = frozenset({"startup_seconds", "engine_step_seconds", "gc_pause_seconds", "degraded_requests_total"})
# Titan's name → vLLM's, where they differ.
VLLM_NAMES = {"admission_rejections_total": "num_requests_rejected_total"}
# vLLM's one rejection reason is a full queue; Titan's queue limits are both that. A TTFT-SLO refusal keeps its name.
VLLM_REJECTION_REASONS = {"queue_requests": "queue_full", "queue_tokens": "queue_full"}

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
    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int, prefix: str = "titan",
                 cache_info: dict[str, str] | None = None) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {', '.join(METRICS_PREFIXES)}, not {prefix!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefix = prefix
        # vLLM labels every series with the engine index too; one engine per Titan process.
        self._label_names = ["model_name", "engine"] if prefix == "vllm" else ["model_name"]
        self._label_values = (model_name, "0") if prefix == "vllm" else (model_name,)
        labels = self._label_names

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(self.name(name), doc, labels, registry=self.registry).labels(*self._label_values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(self.name(name), doc, labels, registry=self.registry).labels(*self._label_values)

        def histogram(name: str, doc: str, buckets: list[float] | tuple[float, ...]) -> Histogram:
            return Histogram(self.name(name), doc, labels, buckets=buckets,
                             registry=self.registry).labels(*self._label_values)

        def labelled_counter(name: str, doc: str, label: str) -> Counter:
            return Counter(self.name(name), doc, [*labels, label], registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.startup_seconds = gauge("startup_seconds", "Cold start: process start until ready to serve.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prefilled prompt tokens (counted at first token).")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.num_preemptions = counter("num_preemptions_total", "Preemptions of running requests.")
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits_total", "Tokens found in the prefix cache.")
        self._success = labelled_counter("request_success_total", "Finished requests by finish reason.",
                                         "finished_reason")
        self.success = {reason: self._success.labels(*self._label_values, reason)
                        for reason in ("stop", "length", "abort")}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_TIME_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "First scheduled to finish (prefill and decode).", REQUEST_TIME_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Per request: decode time over its output tokens after the first.",
                                               ITL_BUCKETS)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Generated tokens per request.", token_buckets)
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Per request: the most tokens any of its n choices generated.",
            token_buckets)
        self.request_params_n = histogram("request_params_n", "The n of each request.", (1, 2, 5, 10, 20))
        self.request_params_max_tokens = histogram("request_params_max_tokens", "The max_tokens of each request.",
                                                   token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                          power_of_two_buckets(max_num_batched_tokens))
        self.step_seconds = histogram("engine_step_seconds", "Wall time of one engine step.", ITL_BUCKETS)
        self.gc_pause = Histogram(self.name("gc_pause_seconds"), "Garbage-collector pauses, by generation.",
                                  [*labels, "generation"], buckets=ITL_BUCKETS, registry=self.registry)
        self.admission_rejections = labelled_counter(
            "admission_rejections_total", "Requests refused by admission control (HTTP 429), by reason.", "reason")
        self.degradations = labelled_counter(
            "degraded_requests_total", "Requests degraded under pressure (e.g. max_tokens clamped), by kind.", "kind")
        if cache_info is not None:
            # vLLM's info gauge: the KV cache's configuration as labels (and the engine's, no model), value 1.
            if prefix == "vllm":
                cache_info = cache_info | {"engine": "0"}
            info = Gauge(self.name("cache_config_info"), "The KV cache's configuration.", sorted(cache_info),
                         registry=self.registry)
            info.labels(**cache_info).set(1)
        # Speculative decoding (vLLM's names); they appear once speculation is configured.
        self.spec_drafts = counter("spec_decode_num_drafts_total", "Verifications: sequence-steps that carried drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens_total", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
        self._spec_per_position = labelled_counter("spec_decode_num_accepted_tokens_per_pos_total",
                                                   "Draft tokens accepted, by position in the draft (0 = first).",
                                                   "position")
        self._last_stats: EngineStats | None = None

    def name(self, metric: str) -> str:
        """The exposed name of a metric Titan calls `metric` (e.g. `num_requests_waiting`)."""
        if self.prefix == "vllm" and metric not in TITAN_ONLY:
            return "vllm:" + VLLM_NAMES.get(metric, metric)
        return PREFIX + metric

    # ---- engine thread -------------------------------------------------------------------------
    def record_admission_rejection(self, reason: str) -> None:
        if self.prefix == "vllm":
            reason = VLLM_REJECTION_REASONS.get(reason, reason)
        self.admission_rejections.labels(*self._label_values, reason).inc()

    def record_degradation(self, kind: str) -> None:
        self.degradations.labels(*self._label_values, kind).inc()

    def record_gc_pause(self, generation: int, seconds: float) -> None:
        self.gc_pause.labels(*self._label_values, str(generation)).observe(seconds)

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
            series = self._spec_per_position.labels(*self._label_values, str(position))
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
            if output.num_output_tokens > 1:
                self.time_per_output_token.observe((finished - first_token) / (output.num_output_tokens - 1))
        if scheduled is not None and finished is not None:
            self.inference_time.observe(finished - scheduled)
        self.request_prompt_tokens.observe(output.num_prompt_tokens)
        self.request_generation_tokens.observe(output.num_output_tokens)

    def record_request(self, n: int, max_tokens: int, max_generation_tokens: int) -> None:
        """One prompt's group of `n` choices, once all of them finished (vLLM's request_params_*)."""
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)
        self.request_max_generation_tokens.observe(max_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
