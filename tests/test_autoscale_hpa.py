"""The HPA algorithm against hand-computed cases: ratio, tolerance, missing and unready pods, windows."""

import pytest

from titan.autoscale.hpa import (
    DEFAULT_SCALE_DOWN,
    DEFAULT_SCALE_UP,
    Behavior,
    HorizontalPodAutoscaler,
    HpaSpec,
    PodMetrics,
    ScaleEvent,
    ScalingPolicy,
    ScalingRules,
    Tolerance,
    metric_replicas,
    scale_down_limit,
    scale_up_limit,
    usage_ratio,
)


def rules(window: int, *policies: tuple[str, int, int], select: str = "Max") -> ScalingRules:
    return ScalingRules(window, tuple(ScalingPolicy(*policy) for policy in policies), select)


# ---- one metric's proposal ----------------------------------------------------------------------------
def test_ratio_inside_tolerance_keeps_the_count():
    # mean 5.4 / target 5 = 1.08: within 10 %, stay at 3 even though ceil(1.08 * 3) = 4.
    assert metric_replicas(PodMetrics([5.4, 5.4, 5.4]), 5, 3) == 3
    # mean 4.6 / 5 = 0.92: within 10 % on the way down too.
    assert metric_replicas(PodMetrics([4.6, 4.6, 4.6]), 5, 3) == 3


def test_ratio_outside_tolerance_is_ceil_of_ratio_times_pods():
    # mean 5.6 / 5 = 1.12 -> ceil(3.36) = 4
    assert metric_replicas(PodMetrics([5.6, 5.6, 5.6]), 5, 3) == 4
    # mean 2 / 5 = 0.4 over 10 pods -> 4
    assert metric_replicas(PodMetrics([2.0] * 10), 5, 10) == 4
    # mean 0 -> 0 (min/max clamping happens later)
    assert metric_replicas(PodMetrics([0.0, 0.0]), 5, 2) == 0


def test_tolerance_edges_and_asymmetric_bands():
    assert metric_replicas(PodMetrics([5.5] * 10), 5, 10) == 10  # ratio exactly 1.1: still within
    assert metric_replicas(PodMetrics([5.6] * 10), 5, 10) == 12  # 1.12 * 10 = 11.2 -> 12
    assert metric_replicas(PodMetrics([4.5] * 10), 5, 10) == 10  # 0.9: within
    # With a 0 scale-up tolerance any excess scales: 1.02 * 10 = 10.2 -> 11.
    eager = Tolerance(scale_down=0.1, scale_up=0.0)
    assert metric_replicas(PodMetrics([5.1] * 10), 5, 10, tolerance=eager) == 11
    # The proposal multiplies by the pods that reported, not by the Deployment's count.
    assert metric_replicas(PodMetrics([5.6]), 5, 10) == 2


def test_values_are_truncated_to_the_api_resolution():
    # CPU utilization is a whole percent: mean 77.9 % -> 77 %; 77 / 70 = 1.1 -> within tolerance.
    assert usage_ratio([77.9], 70, "utilization") == pytest.approx(1.1)
    assert metric_replicas(PodMetrics([77.9, 77.9]), 70, 2, "utilization") == 2
    # 78 % / 70 = 1.114 -> ceil(2.23) = 3
    assert metric_replicas(PodMetrics([78.0, 78.0]), 70, 2, "utilization") == 3
    # Milli-units: 1/3 + 1/3 + 1/3 -> 334m each (MilliValue rounds up), mean 1002m / 3 = 334m.
    assert usage_ratio([1 / 3] * 3, 1, "average_value") == pytest.approx(0.334)


def test_no_values_keeps_the_count():
    assert metric_replicas(PodMetrics([], num_missing=3), 5, 3) == 3


def test_missing_pods_count_as_zero_on_scale_up():
    # 2 pods report 10 (ratio 2), 2 have no value yet: refilled as 0 -> mean 5, ratio 1.0 -> keep 4.
    assert metric_replicas(PodMetrics([10.0, 10.0], num_missing=2), 5, 4) == 4
    # 2 pods report 20 (ratio 4); with 2 zeros mean 10, ratio 2 -> ceil(2 * 4) = 8.
    assert metric_replicas(PodMetrics([20.0, 20.0], num_missing=2), 5, 4) == 8


def test_missing_pods_count_as_target_on_scale_down():
    # 2 pods at 1 (ratio 0.2), 2 missing set to the target 5: mean 3, ratio 0.6 -> ceil(0.6 * 4) = 3.
    assert metric_replicas(PodMetrics([1.0, 1.0], num_missing=2), 5, 4) == 3
    # For CPU utilization missing pods are taken at 100 % of their request: (10 + 10 + 100 + 100) / 4 = 55 %,
    # 55 / 70 = 0.786 -> ceil(3.14) = 4: the missing pods cancel the scale-down.
    assert metric_replicas(PodMetrics([10.0, 10.0], num_missing=2), 70, 4, "utilization") == 4


def test_unready_pods_count_as_zero_on_scale_up_only():
    # 3 ready pods at 8 (ratio 1.6) and 1 unready: (24 + 0) / 4 = 6, ratio 1.2 -> ceil(4.8) = 5.
    assert metric_replicas(PodMetrics([8.0, 8.0, 8.0], num_unready=1), 5, 4) == 5
    # Scale-down: unready pods are simply left out: ratio 0.4 over the 3 ready -> ceil(1.2) = 2.
    assert metric_replicas(PodMetrics([2.0, 2.0, 2.0], num_unready=1), 5, 4) == 2


def test_refill_that_flips_direction_keeps_the_count():
    # 1 ready pod at 6 (ratio 1.2), 2 unready -> (6 + 0 + 0) / 3 = 2, ratio 0.4: the refill turned a scale-up
    # into a scale-down, so nothing changes.
    assert metric_replicas(PodMetrics([6.0], num_unready=2), 5, 3) == 3


# ---- policies -------------------------------------------------------------------------------------------
def test_default_scale_up_allows_double_or_plus_four():
    assert scale_up_limit(4, 0.0, [], [], DEFAULT_SCALE_UP) == 8  # max(4 * 2, 4 + 4)
    assert scale_up_limit(1, 0.0, [], [], DEFAULT_SCALE_UP) == 5  # max(2, 5)
    assert scale_up_limit(10, 0.0, [], [], DEFAULT_SCALE_UP) == 20  # max(20, 14)


def test_select_policy_min_and_disabled():
    up = rules(0, ("Percent", 100, 15), ("Pods", 4, 15), select="Min")
    assert scale_up_limit(10, 0.0, [], [], up) == 14  # min(20, 14)
    disabled = rules(0, ("Percent", 100, 15), select="Disabled")
    assert scale_up_limit(10, 0.0, [], [], disabled) == 10
    assert scale_down_limit(10, 0.0, [], [], disabled) == 10


def test_scale_events_within_the_period_count_against_the_limit():
    up = rules(0, ("Percent", 100, 60), ("Pods", 4, 60))
    # 3 pods were added 30 s ago: the period started at 10 - 3 = 7 -> max(ceil(7 * 2), 7 + 4) = 14.
    assert scale_up_limit(10, 100.0, [ScaleEvent(70.0, 3)], [], up) == 14
    # 60 s ago exactly is outside the period (strictly after the cutoff counts).
    assert scale_up_limit(10, 130.0, [ScaleEvent(70.0, 3)], [], up) == 20
    # A scale-down in the period raises the base: 10 + 2 -> max(24, 16).
    assert scale_up_limit(10, 100.0, [], [ScaleEvent(90.0, 2)], up) == 24


def test_percent_policies_round_like_the_controller():
    assert scale_up_limit(3, 0.0, [], [], rules(0, ("Percent", 10, 15))) == 4  # ceil(3.3)
    assert scale_down_limit(5, 0.0, [], [], rules(0, ("Percent", 30, 15))) == 3  # int(3.5): truncated
    # float64 arithmetic, as in Go: 25 * (1 + 0.12) = 28.000000000000004 -> 29, and
    # 10 * (1 - 0.9) = 0.9999999999999998 -> 0.
    assert scale_up_limit(25, 0.0, [], [], rules(0, ("Percent", 12, 15))) == 29
    assert scale_down_limit(10, 0.0, [], [], rules(0, ("Percent", 90, 15))) == 0


def test_scale_down_select_policy():
    down = rules(300, ("Percent", 50, 60), ("Pods", 2, 60))
    assert scale_down_limit(10, 0.0, [], [], down) == 5  # Max: the biggest change -> min(5, 8)
    smallest_step = rules(300, ("Percent", 50, 60), ("Pods", 2, 60), select="Min")
    assert scale_down_limit(10, 0.0, [], [], smallest_step) == 8
    # 2 pods were removed 30 s ago: the period started at 6 + 2 = 8 -> min(int(8 * 0.5), 8 - 2) = 4.
    assert scale_down_limit(6, 100.0, [], [ScaleEvent(70.0, 2)], down) == 4


# ---- the controller: stabilization and limits over time ------------------------------------------------
def run(hpa: HorizontalPodAutoscaler, start: int, proposals: list[int], period: float = 15.0) -> list[int]:
    """Feed one proposal per sync; the Deployment follows each decision at once."""
    current, counts = start, []
    for step, proposal in enumerate(proposals):
        current = hpa.reconcile(step * period, current, proposal).desired
        counts.append(current)
    return counts


def test_scale_down_waits_for_the_stabilization_window():
    behavior = Behavior(DEFAULT_SCALE_UP, rules(60, ("Percent", 100, 15)))
    hpa = HorizontalPodAutoscaler(HpaSpec(1, 10, behavior))
    # t = 0, 15, 30, 45: the window still holds the initial 10 (seeded at t = 0) -> stay at 10.
    # t = 60: the t = 0 record is exactly 60 s old and drops out; the others all say 4 -> 4.
    assert run(hpa, 10, [4, 4, 4, 4, 4, 4]) == [10, 10, 10, 10, 4, 4]


def test_scale_down_window_takes_the_highest_recent_recommendation():
    behavior = Behavior(DEFAULT_SCALE_UP, rules(45, ("Percent", 100, 15)))
    hpa = HorizontalPodAutoscaler(HpaSpec(1, 10, behavior))
    # Proposals 8, 6, 3, 3, 3 from 8 replicas: the window (45 s) keeps the max of the last three syncs.
    # t=0: seeded 8 -> 8; t=15: max(8, 6) = 8; t=30: max(8, 6, 3) = 8; t=45: recs after 0: 6, 3, 3 -> 6;
    # t=60: recs after 15: 3, 3, 3 -> 3.
    assert run(hpa, 8, [8, 6, 3, 3, 3]) == [8, 8, 8, 6, 3]


def test_scale_up_window_takes_the_lowest_recent_recommendation():
    behavior = Behavior(rules(30, ("Percent", 100, 15), ("Pods", 4, 15)), rules(0, ("Percent", 100, 15)))
    hpa = HorizontalPodAutoscaler(HpaSpec(1, 20, behavior))
    # From 2: proposals 6, 6, 6. t=0: only itself -> 6 (no earlier record). t=15: min(6, 6) = 6.
    assert run(hpa, 2, [6, 6, 6]) == [6, 6, 6]
    hpa = HorizontalPodAutoscaler(HpaSpec(1, 20, behavior))
    # A one-sync spike: 2, 9, 2 -> t=15: min(2, 9) = 2 over the last 30 s; no scale-up at all.
    assert run(hpa, 2, [2, 9, 2, 2]) == [2, 2, 2, 2]


def test_rate_limit_spreads_a_big_scale_up_over_periods():
    behavior = Behavior(rules(0, ("Pods", 2, 60)), DEFAULT_SCALE_DOWN)
    hpa = HorizontalPodAutoscaler(HpaSpec(1, 20, behavior))
    decisions = []
    current = 2
    for step in range(6):
        decision = hpa.reconcile(step * 15.0, current, 10)
        decisions.append((decision.desired, decision.reason))
        current = decision.desired
    # +2 at t=0; t=15..45: the +2 is inside the 60 s period -> capped at 4; t=60: it left the period -> 6.
    assert [d for d, _ in decisions] == [4, 4, 4, 4, 6, 6]
    assert decisions[0][1] == "ScaleUpLimit"


def test_min_and_max_replicas_clamp():
    hpa = HorizontalPodAutoscaler(HpaSpec(2, 5, Behavior(DEFAULT_SCALE_UP, rules(0, ("Percent", 100, 15)))))
    assert hpa.reconcile(0.0, 3, 40).desired == 5  # TooManyReplicas
    assert hpa.reconcile(15.0, 5, 0).desired == 2  # TooFewReplicas
    assert hpa.reconcile(30.0, 7, 7).desired == 5  # above maxReplicas: straight to max
    assert hpa.reconcile(45.0, 1, 1).desired == 2  # below minReplicas: straight to min


def test_behavior_from_kubernetes_fills_defaults():
    one_pod = {"type": "Pods", "value": 1, "periodSeconds": 30}
    scale_down = {"stabilizationWindowSeconds": 60, "policies": [one_pod]}
    behavior = Behavior.from_kubernetes({"scaleDown": scale_down})
    assert behavior.scale_up == DEFAULT_SCALE_UP
    assert behavior.scale_down == rules(60, ("Pods", 1, 30))
    assert Behavior.from_kubernetes(None) == Behavior()
    assert Behavior.from_kubernetes(behavior.to_kubernetes()) == behavior
    with pytest.raises(ValueError):
        Behavior.from_kubernetes({"scaleUp": {"selectPolicy": "Sometimes"}})
