"""Kubernetes' HorizontalPodAutoscaler (autoscaling/v2) decisions, step for step as the controller takes them.

Each sync has two stages:

1. Every metric proposes a replica count (`metric_replicas`): ratio = mean pod value / target. Inside the
   tolerance band nothing changes; otherwise ceil(ratio x pods with values). When pods lack values (missing)
   or are not ready, they are filled in - 0 on a scale-up, the target (100 % for CPU) on a scale-down - the
   ratio is recomputed, and if that lands in the band or flips direction nothing changes. The HPA takes the
   largest proposal over its metrics.
2. The proposal is stabilized (scale-up: the lowest recommendation within the up window; scale-down: the
   highest within the down window), rate-limited by the policies (Pods / Percent per period, combined by
   selectPolicy) and clamped to [minReplicas, maxReplicas].

Arithmetic follows the controller, float quirks included (a Percent policy computes `n * (1 + p/100)` in
float64 and rounds up, so 10 replicas +10 % gives 12). Averages are truncated to the API's resolution
(whole percent for utilization, milli-units for values). Time comparisons are strict like Go's
`After(cutoff)`: a recommendation or scale event exactly one window old no longer counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

PolicyType = Literal["Pods", "Percent"]
SelectPolicy = Literal["Max", "Min", "Disabled"]
# "utilization": percent of the pods' requests (Resource metrics such as CPU); "average_value": a
# per-pod value (Pods metrics, or External/Object metrics with an AverageValue target).
MetricKind = Literal["utilization", "average_value"]


@dataclass(frozen=True)
class ScalingPolicy:
    type: PolicyType
    value: int
    period_seconds: int


@dataclass(frozen=True)
class ScalingRules:
    stabilization_window_seconds: int
    policies: tuple[ScalingPolicy, ...]
    select_policy: SelectPolicy = "Max"

    @property
    def longest_period(self) -> int:
        return max((policy.period_seconds for policy in self.policies), default=0)


# The API server's defaults for a behavior field left out (or an HPA without `behavior`).
DEFAULT_SCALE_UP = ScalingRules(0, (ScalingPolicy("Percent", 100, 15), ScalingPolicy("Pods", 4, 15)))
DEFAULT_SCALE_DOWN = ScalingRules(300, (ScalingPolicy("Percent", 100, 15),))


def _rules_from_kubernetes(spec: Mapping[str, Any] | None, default: ScalingRules) -> ScalingRules:
    if spec is None:
        return default
    policies = tuple(ScalingPolicy(item["type"], int(item["value"]), int(item["periodSeconds"]))
                     for item in spec.get("policies", []))
    for policy in policies:
        valid_period = 0 < policy.period_seconds <= 1800
        if policy.type not in ("Pods", "Percent") or policy.value <= 0 or not valid_period:
            raise ValueError(f"invalid scaling policy {policy}")
    select = spec.get("selectPolicy", "Max")
    if select not in ("Max", "Min", "Disabled"):
        raise ValueError(f"invalid selectPolicy {select!r}")
    window = int(spec.get("stabilizationWindowSeconds", default.stabilization_window_seconds))
    if not 0 <= window <= 3600:
        raise ValueError(f"stabilizationWindowSeconds must be in [0, 3600], got {window}")
    return ScalingRules(window, policies or default.policies, select)


def _rules_to_kubernetes(rules: ScalingRules) -> dict[str, Any]:
    return {
        "stabilizationWindowSeconds": rules.stabilization_window_seconds,
        "selectPolicy": rules.select_policy,
        "policies": [{"type": policy.type, "value": policy.value, "periodSeconds": policy.period_seconds}
                     for policy in rules.policies],
    }


@dataclass(frozen=True)
class Behavior:
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN

    @classmethod
    def from_kubernetes(cls, spec: Mapping[str, Any] | None) -> Behavior:
        """From an HPA's `spec.behavior` (camelCase, as in the manifest); missing parts take the defaults."""
        spec = spec or {}
        return cls(_rules_from_kubernetes(spec.get("scaleUp"), DEFAULT_SCALE_UP),
                   _rules_from_kubernetes(spec.get("scaleDown"), DEFAULT_SCALE_DOWN))

    def to_kubernetes(self) -> dict[str, Any]:
        return {"scaleUp": _rules_to_kubernetes(self.scale_up),
                "scaleDown": _rules_to_kubernetes(self.scale_down)}


@dataclass(frozen=True)
class Tolerance:
    """No change while scale_down <= 1 - ratio and ratio - 1 <= scale_up (the controller's default 0.1)."""

    scale_down: float = 0.1
    scale_up: float = 0.1

    def within(self, ratio: float) -> bool:
        return 1.0 - self.scale_down <= ratio <= 1.0 + self.scale_up


@dataclass(frozen=True)
class PodMetrics:
    """One metric as the HPA sees it at one sync, for the pods the Deployment currently has."""

    values: Sequence[float]  # ready pods that reported a value (percent for utilization)
    num_unready: int = 0  # Pending pods; for CPU also pods not yet ready in their initialization period
    num_missing: int = 0  # running pods with no value yet


def usage_ratio(values: Sequence[float], target: float, kind: MetricKind) -> float:
    """Mean / target at the API's resolution: whole percent for utilization, milli-units for values."""
    if kind == "utilization":
        return float(math.floor(sum(values) / len(values) + 1e-9)) / float(int(target))
    total_milli = sum(math.ceil(value * 1000 - 1e-9) for value in values)  # Quantity.MilliValue rounds up
    return float(total_milli // len(values)) / float(math.ceil(target * 1000 - 1e-9))


def metric_replicas(metrics: PodMetrics, target: float, current_replicas: int,
                    kind: MetricKind = "average_value", tolerance: Tolerance = Tolerance()) -> int:
    """The count one metric proposes (the controller's calcPlainMetricReplicas / GetResourceReplicas)."""
    values = list(metrics.values)
    if not values:
        return current_replicas  # the controller errors out and leaves the scale alone
    ratio = usage_ratio(values, target, kind)
    scale_up_with_unready = metrics.num_unready > 0 and ratio > 1.0
    if not scale_up_with_unready and metrics.num_missing == 0:
        if tolerance.within(ratio):
            return current_replicas
        return math.ceil(ratio * len(values))
    if metrics.num_missing:
        # Scale-down: missing pods are taken to sit at the target (at 100 % of their request for CPU);
        # scale-up: at zero. Either way they can only damp the change.
        fill = (100.0 if kind == "utilization" else target) if ratio < 1.0 else 0.0
        values += [fill] * metrics.num_missing
    if scale_up_with_unready:
        values += [0.0] * metrics.num_unready
    new_ratio = usage_ratio(values, target, kind)
    if tolerance.within(new_ratio) or (ratio > 1.0 > new_ratio) or (ratio < 1.0 < new_ratio):
        return current_replicas
    proposal = math.ceil(new_ratio * len(values))
    if (new_ratio < 1.0 and proposal > current_replicas) or (new_ratio > 1.0 and proposal < current_replicas):
        return current_replicas
    return proposal


@dataclass(frozen=True)
class ScaleEvent:
    time: float
    change: int  # replicas added (scale-up list) or removed (scale-down list), > 0


def _change_in_period(events: Sequence[ScaleEvent], now: float, period: int) -> int:
    cutoff = now - period
    return sum(event.change for event in events if event.time > cutoff)


def scale_up_limit(current: int, now: float, up_events: Sequence[ScaleEvent],
                   down_events: Sequence[ScaleEvent], rules: ScalingRules) -> int:
    """Most replicas the scale-up policies allow now (calculateScaleUpLimitWithScalingRules)."""
    if rules.select_policy == "Disabled":
        return current
    proposals = []
    for policy in rules.policies:
        period_start = (current - _change_in_period(up_events, now, policy.period_seconds)
                        + _change_in_period(down_events, now, policy.period_seconds))
        if policy.type == "Pods":
            proposals.append(period_start + policy.value)
        else:  # rounded up so that a small percentage of a small fleet still adds a pod
            proposals.append(math.ceil(float(period_start) * (1 + float(policy.value) / 100)))
    return min(proposals) if rules.select_policy == "Min" else max(proposals)


def scale_down_limit(current: int, now: float, up_events: Sequence[ScaleEvent],
                     down_events: Sequence[ScaleEvent], rules: ScalingRules) -> int:
    """Fewest replicas the scale-down policies allow now (calculateScaleDownLimitWithBehaviors)."""
    if rules.select_policy == "Disabled":
        return current
    proposals = []
    for policy in rules.policies:
        period_start = (current - _change_in_period(up_events, now, policy.period_seconds)
                        + _change_in_period(down_events, now, policy.period_seconds))
        if policy.type == "Pods":
            proposals.append(period_start - policy.value)
        else:  # truncated like Go's int32(float64) conversion
            proposals.append(int(float(period_start) * (1 - float(policy.value) / 100)))
    # "Min" selects the smallest change, which for a scale-down is the largest count.
    return max(proposals) if rules.select_policy == "Min" else min(proposals)


@dataclass(frozen=True)
class HpaSpec:
    min_replicas: int
    max_replicas: int
    behavior: Behavior = Behavior()
    tolerance: Tolerance = Tolerance()

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("need 1 <= minReplicas <= maxReplicas, "
                             f"got {self.min_replicas}, {self.max_replicas}")


@dataclass(frozen=True)
class Decision:
    time: float
    current: int
    proposal: int  # what the metrics asked for
    stabilized: int  # after the stabilization windows
    desired: int  # after the policies and min/max: what the Deployment is scaled to
    reason: str


@dataclass
class HorizontalPodAutoscaler:
    """The controller's per-HPA state (recommendations and scale events) and its reconcile step."""

    spec: HpaSpec
    recommendations: list[tuple[float, int]] | None = None
    up_events: list[ScaleEvent] = field(default_factory=list)
    down_events: list[ScaleEvent] = field(default_factory=list)

    def reconcile(self, now: float, current: int, proposal: int) -> Decision:
        spec = self.spec
        if current > spec.max_replicas:
            decision = Decision(now, current, proposal, proposal, spec.max_replicas, "above maxReplicas")
        elif current < spec.min_replicas:
            decision = Decision(now, current, proposal, proposal, spec.min_replicas, "below minReplicas")
        else:
            stabilized = self._stabilize(now, current, proposal)
            desired, reason = self._limit(now, current, stabilized)
            decision = Decision(now, current, proposal, stabilized, desired, reason)
        if decision.desired != current:
            self._record_scale(now, current, decision.desired)
        return decision

    def _stabilize(self, now: float, current: int, proposal: int) -> int:
        behavior = self.spec.behavior
        if self.recommendations is None:
            # A fresh controller starts the down window at the current count, so it never scales down at once.
            self.recommendations = []
            if behavior.scale_down.stabilization_window_seconds > 0:
                self.recommendations.append((now, current))
        up_cutoff = now - behavior.scale_up.stabilization_window_seconds
        down_cutoff = now - behavior.scale_down.stabilization_window_seconds
        up_floor = down_ceiling = proposal
        for stamp, recommendation in self.recommendations:
            if stamp > up_cutoff:
                up_floor = min(up_floor, recommendation)
            if stamp > down_cutoff:
                down_ceiling = max(down_ceiling, recommendation)
        # Keep only what a later sync can still use, then record the raw proposal.
        oldest_useful = min(up_cutoff, down_cutoff)
        self.recommendations = [item for item in self.recommendations if item[0] > oldest_useful]
        self.recommendations.append((now, proposal))
        return min(max(current, up_floor), down_ceiling)

    def _limit(self, now: float, current: int, desired: int) -> tuple[int, str]:
        spec = self.spec
        if desired > current:
            rules = spec.behavior.scale_up
            limit = max(scale_up_limit(current, now, self.up_events, self.down_events, rules), current)
            allowed = min(spec.max_replicas, limit)
            if desired > allowed:
                return allowed, "ScaleUpLimit" if allowed < spec.max_replicas else "TooManyReplicas"
        elif desired < current:
            rules = spec.behavior.scale_down
            limit = min(scale_down_limit(current, now, self.up_events, self.down_events, rules), current)
            allowed = max(spec.min_replicas, limit)
            if desired < allowed:
                return allowed, "ScaleDownLimit" if allowed > spec.min_replicas else "TooFewReplicas"
        return desired, "DesiredWithinRange"

    def _record_scale(self, now: float, before: int, after: int) -> None:
        behavior = self.spec.behavior
        if after > before:
            horizon = now - behavior.scale_up.longest_period
            self.up_events = [event for event in self.up_events if event.time > horizon]
            self.up_events.append(ScaleEvent(now, after - before))
        else:
            horizon = now - behavior.scale_down.longest_period
            self.down_events = [event for event in self.down_events if event.time > horizon]
            self.down_events.append(ScaleEvent(now, before - after))


def proposal_over_metrics(proposals: Sequence[int], current: int) -> int:
    """Several metrics: the largest proposal wins (none valid: keep the current count)."""
    return max(proposals, default=current)
