"""The autoscaling simulator: capacity curves, traces, the replica model, flapping detection and the CLI."""

import csv
import json

import numpy as np
import pytest

from titan.autoscale.capacity import EXAMPLE_PROFILE, CapacityProfile, load_capacity
from titan.autoscale.hpa import Behavior, HpaSpec, ScalingPolicy, ScalingRules
from titan.autoscale.policies import MetricTarget, Policy, load_policies, parse_quantity, presets
from titan.autoscale.report import ScaleChange, Slo, oscillation, scale_changes, slo_violations, summarize
from titan.autoscale.simulator import SimulationConfig, simulate
from titan.autoscale.traces import (
    Arrival,
    RateTrace,
    bursty,
    constant,
    diurnal,
    load_trace_csv,
    sample_arrivals,
    work_sizes,
)
from titan.entrypoints.cli import main

FLAT = CapacityProfile((1.0, 4.0), (2.0, 2.0), max_concurrency=4)  # 2 s per request at up to 4 at once


def fixed_fleet(replicas: int, metric: MetricTarget | None = None) -> Policy:
    """min = max: the HPA can never change the count."""
    return Policy("fixed", (metric or MetricTarget("waiting", 5, 60),), HpaSpec(replicas, replicas))


# ---- capacity -------------------------------------------------------------------------------------------
def test_latency_curve_interpolates_and_holds_throughput_past_the_last_point():
    profile = CapacityProfile((1.0, 4.0, 8.0), (2.0, 2.4, 3.0), max_concurrency=16)
    assert profile.latency_at(0.5) == 2.0
    assert profile.latency_at(2) == pytest.approx(2.0 + 0.4 / 3)
    assert profile.latency_at(16) == pytest.approx(6.0)  # 3 s * 16 / 8: throughput stays 8 / 3
    assert profile.throughput_at(8) == pytest.approx(8 / 3)
    assert profile.max_throughput == pytest.approx(8 / 3)
    with pytest.raises(ValueError):
        CapacityProfile((4.0, 1.0), (2.0, 2.0), 4)


def bench_result(request_rate, max_concurrency, throughput, e2e_mean_ms):
    return {"schema": "titan-bench/1",
            "config": {"request_rate": request_rate, "max_concurrency": max_concurrency},
            "summary": {"request_throughput": throughput}, "latency_ms": {"e2e": {"mean": e2e_mean_ms}}}


def test_capacity_from_bench_results_and_capacity_files(tmp_path):
    # Closed loop at concurrency 4: a point at 4; open loop at 1 req/s with 2 s mean: Little's law -> 2.
    (tmp_path / "rate-1").mkdir()
    (tmp_path / "rate-1" / "result.json").write_text(json.dumps(bench_result(1.0, None, 1.0, 2000.0)))
    (tmp_path / "c4").mkdir()
    (tmp_path / "c4" / "result.json").write_text(json.dumps(bench_result(None, 4, 1.6, 2500.0)))
    profile = load_capacity([tmp_path / "rate-1", tmp_path / "c4" / "result.json"], cold_start_s=45)
    assert profile.concurrency == (2.0, 4.0)
    assert profile.latency_s == (2.0, 2.5)
    assert profile.max_concurrency == 4 and profile.cold_start_s == 45
    # A sweep summary brings its rate-*/result.json folders along.
    (tmp_path / "sweep.json").write_text(json.dumps({"schema": "titan-bench-sweep/1", "points": []}))
    assert load_capacity([tmp_path / "sweep.json"]).concurrency == (2.0,)

    capacity_file = tmp_path / "capacity.json"
    capacity_file.write_text(json.dumps({
        "schema": "titan-capacity/1", "max_concurrency": 32, "cold_start_s": 90,
        "points": [{"concurrency": 1, "latency_s": 1.5}, {"throughput_rps": 4.0, "latency_s": 2.0}],
    }))
    profile = load_capacity([capacity_file])
    assert profile.concurrency == (1.0, 8.0) and profile.max_concurrency == 32 and profile.cold_start_s == 90
    assert load_capacity([capacity_file], max_concurrency=8).max_concurrency == 8


def test_capacity_rejects_what_it_cannot_use(tmp_path):
    lone_sweep = tmp_path / "alone" / "sweep.json"
    lone_sweep.parent.mkdir()
    lone_sweep.write_text(json.dumps({"schema": "titan-bench-sweep/1", "points": []}))
    with pytest.raises(ValueError, match="rate-"):
        load_capacity([lone_sweep])
    empty_run = tmp_path / "empty.json"
    empty_run.write_text(json.dumps(bench_result(1.0, None, 0.0, None)))
    with pytest.raises(ValueError):
        load_capacity([empty_run])
    with pytest.raises(ValueError):
        load_capacity([tmp_path])  # a folder with no result.json


# ---- traces ---------------------------------------------------------------------------------------------
def test_generated_rate_curves():
    day = diurnal(2.0, 30.0, 3600.0, 7200.0)
    assert day.rate_at(0) == pytest.approx(2.0)
    assert day.rate_at(1800) == pytest.approx(30.0)
    assert day.rate_at(3600) == pytest.approx(2.0)
    burst = bursty(1.0, 10.0, period=600.0, burst_length=60.0, duration=1200.0)
    assert burst.rate_at(100) == 1.0 and burst.rate_at(330) == 10.0 and burst.rate_at(500) == 1.0
    assert burst.rate_at(930) == 10.0
    assert constant(5.0, 100.0).expected_requests() == pytest.approx(500.0)


def test_arrivals_follow_the_rate_and_are_seeded():
    trace = RateTrace((0.0, 1000.0, 2000.0), (1.0, 1.0, 9.0))  # 1000 + 5000 expected
    arrivals = sample_arrivals(trace, seed=3)
    times = np.array([arrival.time for arrival in arrivals])
    first, second = int((times < 1000).sum()), int((times >= 1000).sum())
    assert abs(first - 1000) < 4 * 1000**0.5 and abs(second - 5000) < 4 * 5000**0.5
    assert np.all(np.diff(times) >= 0)
    assert sample_arrivals(trace, seed=3) == arrivals and sample_arrivals(trace, seed=4) != arrivals
    sizes = work_sizes(20000, 0.5, np.random.default_rng(0))
    assert sizes.mean() == pytest.approx(1.0, abs=0.02) and sizes.std() == pytest.approx(0.5, abs=0.02)
    assert np.all(work_sizes(5, 0.0, np.random.default_rng(0)) == 1.0)


def test_trace_csv_shapes(tmp_path):
    rates = tmp_path / "rates.csv"
    rates.write_text("time_s,rate_rps\n0,1\n60,3\n120,3\n")
    trace = load_trace_csv(rates)
    assert isinstance(trace, RateTrace) and trace.rate_at(30) == 2.0 and trace.duration == 120
    requests = tmp_path / "requests.csv"
    with open(requests, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerows([("arrival_s", "work"), (2.5, 2), (1.0, "")])
    assert load_trace_csv(requests) == [Arrival(1.0, 1.0), Arrival(2.5, 2.0)]
    bad = tmp_path / "bad.csv"
    bad.write_text("when,how_many\n0,1\n")
    with pytest.raises(ValueError, match="header"):
        load_trace_csv(bad)


# ---- the replica model ----------------------------------------------------------------------------------
def test_requests_under_capacity_take_the_curves_latency_and_never_queue():
    arrivals = [Arrival(float(second)) for second in range(100)]  # 1 req/s, 2 s each: 2 running at a time
    result = simulate(arrivals, FLAT, fixed_fleet(1), SimulationConfig(), 110.0)
    assert np.allclose(result.latency, 2.0) and np.allclose(result.queue_delay, 0.0)
    assert result.replica_seconds == pytest.approx(110.0)
    assert not result.aborted.any() and not scale_changes(result.samples)


def test_processor_sharing_slows_everyone_sharing_the_batch():
    profile = CapacityProfile((1.0, 2.0), (2.0, 3.0), max_concurrency=2)
    # Two requests together take 3 s each (not 2 + 2); one alone after them takes 2 s.
    arrivals = [Arrival(0.0), Arrival(0.0), Arrival(10.0)]
    result = simulate(arrivals, profile, fixed_fleet(1), SimulationConfig(), 20.0)
    assert np.allclose(result.finished, [3.0, 3.0, 12.0])


def test_a_full_batch_queues_requests_in_order():
    one_at_a_time = CapacityProfile((1.0,), (2.0,), max_concurrency=1)
    arrivals = [Arrival(float(second)) for second in range(10)]  # 1 req/s into a 0.5 req/s replica
    result = simulate(arrivals, one_at_a_time, fixed_fleet(1), SimulationConfig(), 30.0)
    # Request k starts at 2k: it waited 2k - k = k seconds.
    assert np.allclose(result.queue_delay, np.arange(10.0))
    assert np.allclose(result.finished, 2.0 * np.arange(1, 11))


def test_least_load_routing_spreads_requests():
    arrivals = [Arrival(0.0)] * 4
    result = simulate(arrivals, FLAT, fixed_fleet(2), SimulationConfig(), 10.0)
    assert np.allclose(result.finished, 2.0)  # two per replica, both under its batch limit of 4


def test_scale_down_drains_and_aborts_after_the_drain_timeout():
    no_windows = Behavior(ScalingRules(0, (ScalingPolicy("Percent", 100, 15),)),
                          ScalingRules(0, (ScalingPolicy("Percent", 100, 15),)))
    policy = Policy("drain", (MetricTarget("waiting", 5, 15),), HpaSpec(1, 2, no_windows))
    arrivals = [Arrival(0.0, work=100.0), Arrival(0.0, work=100.0)]  # 200 s each, one per replica
    config = SimulationConfig(initial_replicas=2, drain_timeout_s=25.0)
    result = simulate(arrivals, FLAT, policy, config, 300.0)
    # First sync (15 s): nothing waits, so 2 -> 1; the newer pod drains until 15 + 25 = 40 s and aborts.
    assert scale_changes(result.samples)[0] == ScaleChange(15.0, 2, 1)
    assert result.aborted.tolist() == [False, True]
    assert result.finished.tolist() == pytest.approx([200.0, 40.0])
    assert result.replica_seconds == pytest.approx(300.0 + 40.0)
    assert slo_violations(result, Slo(queue_s=1.0)).tolist() == [False, True]


def test_queue_policy_scales_up_after_a_step_and_waits_for_cold_starts():
    trace = RateTrace((0.0, 300.0, 301.0, 1500.0), (1.0, 1.0, 15.0, 15.0))
    arrivals = sample_arrivals(trace, seed=0, work_cv=0.5)
    policy = presets(EXAMPLE_PROFILE.max_concurrency, 1, 10)["queue-running"]
    config = SimulationConfig(cold_start_s=60.0)
    result = simulate(arrivals, EXAMPLE_PROFILE, policy, config, trace.duration)
    changes = scale_changes(result.samples)
    first_up = next(change for change in changes if change.after > change.before)
    assert 300.0 < first_up.time <= 300.0 + 2 * config.sync_period_s + 60.0
    # Nothing the HPA adds is ready before its cold start is over.
    ready = {sample.time: sample.ready for sample in result.samples}
    assert ready[first_up.time + config.cold_start_s - config.sync_period_s] == first_up.before
    needed = 15.0 / EXAMPLE_PROFILE.max_throughput
    assert result.samples[-1].ready >= needed
    late = result.arrival > 1200.0  # once the fleet caught up, requests hardly wait
    assert np.percentile(result.queue_delay[late], 99) < 1.0


def test_a_flapping_configuration_is_detected_and_a_stable_one_is_not():
    arrivals = sample_arrivals(constant(6.0, 1800.0), seed=1)
    named = presets(EXAMPLE_PROFILE.max_concurrency, 1, 10)
    config = SimulationConfig(cold_start_s=30.0)
    # No stabilization windows, on the queue alone: queue empties -> scale to 1 -> queue -> scale up ...
    flappy = summarize(simulate(arrivals, EXAMPLE_PROFILE, named["queue-fast"], config, 1800.0), Slo())
    stable = summarize(simulate(arrivals, EXAMPLE_PROFILE, named["queue-running"], config, 1800.0), Slo())
    assert flappy["oscillation"]["flapping"] and flappy["oscillation"]["flaps"] >= 10
    assert not stable["oscillation"]["flapping"]
    assert stable["oscillation"]["scale_events"] < flappy["oscillation"]["scale_events"] / 3


def test_oscillation_counts_hand_made_sequences():
    def changes(*events):
        return [ScaleChange(time, before, after) for time, before, after in events]

    # up, up, down (turn at 1000), down, up (turn 200 s after the last one: a flap), down (100 s: a flap)
    sequence = changes((0, 1, 2), (60, 2, 4), (1000, 4, 3), (1100, 3, 2), (1200, 2, 3), (1300, 3, 2))
    assert oscillation(sequence, flap_window_s=600, flap_threshold=3) == oscillation(sequence, 600, 3)
    result = oscillation(sequence, flap_window_s=600, flap_threshold=3)
    assert (result.scale_events, result.scale_ups, result.reversals, result.flaps) == (6, 3, 3, 2)
    assert not result.flapping and oscillation(sequence, 600, 2).flapping
    # A day's peak and trough, hours apart: reversals, but no flaps.
    day = changes((0, 1, 5), (3600, 5, 1), (7200, 1, 5))
    assert oscillation(day).reversals == 2 and oscillation(day).flaps == 0


# ---- policies and the command line ----------------------------------------------------------------------
def test_policy_files(tmp_path):
    assert parse_quantity("500m") == 0.5 and parse_quantity(5) == 5.0 and parse_quantity("1.5k") == 1500.0
    path = tmp_path / "policies.yaml"
    path.write_text(
        "policies:\n"
        "  - name: mine\n    maxReplicas: 6\n    tolerance: 0.05\n"
        "    metrics: [{type: inflight, target: 10, windowSeconds: 30}]\n"
        "    behavior: {scaleDown: {stabilizationWindowSeconds: 120}}\n"
        "---\n"
        "apiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\nmetadata: {name: cpu-hpa}\n"
        "spec:\n  maxReplicas: 4\n  scaleTargetRef: {kind: Deployment, name: titan}\n"
        "  metrics: [{type: Resource,\n"
        "             resource: {name: cpu, target: {type: Utilization, averageUtilization: 60}}}]\n"
    )
    mine, cpu = load_policies(path)
    assert mine.metrics == (MetricTarget("inflight", 10, 30),) and mine.hpa.max_replicas == 6
    assert mine.hpa.behavior.scale_down.stabilization_window_seconds == 120
    assert mine.hpa.tolerance.scale_up == 0.05
    assert cpu.name == "cpu-hpa" and cpu.metrics[0].type == "cpu" and cpu.metrics[0].target == 60


def test_cli_compares_policies_and_writes_a_report_and_plot(tmp_path, capsys):
    output = tmp_path / "out"
    code = main(["autoscale", "simulate", "--pattern", "step", "--duration", "900", "--base-rate", "1",
                 "--peak-rate", "12", "--cold-start", "30", "--policy", "cpu", "--policy", "queue-running",
                 "--output-dir", str(output)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "queue-running" in printed and "replica-min" in printed
    report = json.loads((output / "summary.json").read_text())
    assert [policy["policy"] for policy in report["policies"]] == ["cpu", "queue-running"]
    assert report["traffic"]["requests"] > 0 and report["simulation"]["cold_start_s"] == 30
    for policy in report["policies"]:
        assert policy["replica_minutes"] > 0 and policy["queue_delay_s"]["p99"] is not None
    assert (output / "autoscale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["autoscale", "simulate", "--policy", "nope", "--output-dir", str(output)]) == 2
