"""Autoscaling policies to compare: built-in presets, a policy file, or HPA manifests (e.g. `deploy/k8s`).

A policy is an HPA (min/max, behavior, tolerance) plus the metrics it scales on, each with the averaging
window of the value the HPA reads:

- `cpu`: CPU utilization in percent of the request (Resource metric, metrics-server, ~30 s window). The
  simulator models it as the share of the batch in use: a CPU-bound replica's CPU follows its batch, and it
  cannot exceed 100 %, so it can never say *how far* behind the fleet is. (On a GPU server it is worse: the
  engine loop keeps one core busy at any load.)
- `waiting`: `titan:num_requests_waiting` per pod (Pods metric through Prometheus Adapter, 1 m average).
- `running`: `titan:num_requests_running` per pod; `inflight`: running + waiting per pod.

Policy files are YAML or JSON: either Kubernetes HorizontalPodAutoscaler manifests (any other documents are
skipped, so a `kubectl kustomize` output works) or `{"policies": [{"name", "minReplicas", "maxReplicas",
"metrics": [{"type", "target", "windowSeconds"}], "tolerance", "behavior"}]}` with `behavior` as in an HPA.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from titan.autoscale.hpa import Behavior, HpaSpec, MetricKind, ScalingPolicy, ScalingRules, Tolerance

MetricType = Literal["cpu", "waiting", "running", "inflight"]
METRIC_TYPES: tuple[MetricType, ...] = ("cpu", "waiting", "running", "inflight")
DEFAULT_WINDOWS = {"cpu": 30.0, "waiting": 60.0, "running": 60.0, "inflight": 60.0}


@dataclass(frozen=True)
class MetricTarget:
    type: MetricType
    target: float  # percent for cpu; requests per pod for the others
    window_s: float  # the value the HPA reads is the mean over this window

    def __post_init__(self) -> None:
        if self.type not in METRIC_TYPES:
            raise ValueError(f"unknown metric {self.type!r}; one of {', '.join(METRIC_TYPES)}")
        if self.target <= 0 or self.window_s < 0:
            raise ValueError("metric targets must be > 0 and windows >= 0")

    @property
    def kind(self) -> MetricKind:
        return "utilization" if self.type == "cpu" else "average_value"

    def describe(self) -> str:
        unit = "%" if self.type == "cpu" else "/pod"
        return f"{self.type} {self.target:g}{unit} ({self.window_s:g}s avg)"


@dataclass(frozen=True)
class Policy:
    name: str
    metrics: tuple[MetricTarget, ...]
    hpa: HpaSpec

    def describe(self) -> str:
        up, down = self.hpa.behavior.scale_up, self.hpa.behavior.scale_down
        return (f"{', '.join(m.describe() for m in self.metrics)}; replicas {self.hpa.min_replicas}-"
                f"{self.hpa.max_replicas}; windows up {up.stabilization_window_seconds}s / down "
                f"{down.stabilization_window_seconds}s")


# The behavior deploy/k8s ships: add pods fast (cold starts are slow, so act on the first signal), remove one
# per minute after ten calm minutes (a replica removed too early costs a cold start to bring back).
SHIPPED_BEHAVIOR = Behavior(
    ScalingRules(0, (ScalingPolicy("Percent", 100, 30), ScalingPolicy("Pods", 2, 30)), "Max"),
    ScalingRules(600, (ScalingPolicy("Pods", 1, 60),), "Max"),
)
NO_WINDOWS = Behavior(ScalingRules(0, Behavior().scale_up.policies),
                      ScalingRules(0, Behavior().scale_down.policies))


def presets(max_concurrency: int, min_replicas: int, max_replicas: int) -> dict[str, Policy]:
    """Named policies; targets relative to a replica's batch size where that is what they measure."""
    def hpa(behavior: Behavior) -> HpaSpec:
        return HpaSpec(min_replicas, max_replicas, behavior)

    waiting = MetricTarget("waiting", 5, DEFAULT_WINDOWS["waiting"])
    running = MetricTarget("running", max(1.0, round(0.75 * max_concurrency)), DEFAULT_WINDOWS["running"])
    inflight = MetricTarget("inflight", max(1.0, round(0.8 * max_concurrency)), DEFAULT_WINDOWS["inflight"])
    return {
        "cpu": Policy("cpu", (MetricTarget("cpu", 70, DEFAULT_WINDOWS["cpu"]),), hpa(Behavior())),
        "queue": Policy("queue", (waiting,), hpa(SHIPPED_BEHAVIOR)),
        "queue-running": Policy("queue-running", (waiting, running), hpa(SHIPPED_BEHAVIOR)),
        "queue-fast": Policy("queue-fast", (replace(waiting, window_s=15.0),), hpa(NO_WINDOWS)),
        "inflight": Policy("inflight", (inflight,), hpa(SHIPPED_BEHAVIOR)),
    }


DEFAULT_COMPARISON = ("cpu", "queue", "queue-running", "queue-fast")


def parse_quantity(value: Any) -> float:
    """A Kubernetes quantity as used for metric targets: 5, "5", "500m", "1.5k"."""
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip()
    scales = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    if text and text[-1] in scales:
        return float(text[:-1]) * scales[text[-1]]
    return float(text)


def _metric_from_pods_name(name: str) -> MetricType:
    for key in ("waiting", "running", "inflight"):
        if key in name:
            return key  # type: ignore[return-value]
    raise ValueError(f"Pods metric {name!r}: the simulator knows *waiting*, *running* and *inflight* metrics")


def policy_from_hpa(manifest: dict[str, Any]) -> Policy:
    spec = manifest["spec"]
    metrics = []
    for item in spec.get("metrics", []):
        if item["type"] == "Resource" and item["resource"]["name"] == "cpu":
            target = item["resource"]["target"]
            metrics.append(MetricTarget("cpu", float(target["averageUtilization"]), DEFAULT_WINDOWS["cpu"]))
        elif item["type"] == "Pods":
            kind = _metric_from_pods_name(item["pods"]["metric"]["name"])
            value = parse_quantity(item["pods"]["target"]["averageValue"])
            metrics.append(MetricTarget(kind, value, DEFAULT_WINDOWS[kind]))
        else:
            raise ValueError(f"HPA metric of type {item['type']!r} is not simulated")
    if not metrics:
        raise ValueError("the HPA has no metrics the simulator knows")
    name = manifest.get("metadata", {}).get("name", "hpa")
    hpa = HpaSpec(int(spec.get("minReplicas", 1)), int(spec["maxReplicas"]),
                  Behavior.from_kubernetes(spec.get("behavior")))
    return Policy(name, tuple(metrics), hpa)


def policy_from_dict(data: dict[str, Any]) -> Policy:
    metrics = tuple(
        MetricTarget(item["type"], float(item["target"]),
                     float(item.get("windowSeconds", DEFAULT_WINDOWS.get(item["type"], 60.0))))
        for item in data["metrics"]
    )
    tolerance = float(data.get("tolerance", 0.1))
    hpa = HpaSpec(int(data.get("minReplicas", 1)), int(data["maxReplicas"]),
                  Behavior.from_kubernetes(data.get("behavior")), Tolerance(tolerance, tolerance))
    return Policy(str(data["name"]), metrics, hpa)


def load_policies(path: str | Path) -> list[Policy]:
    import yaml  # only here: the rest of the simulator needs no YAML

    documents: Iterable[Any] = list(yaml.safe_load_all(Path(path).read_text(encoding="utf-8")))
    policies: list[Policy] = []
    for document in documents:
        if not isinstance(document, dict):
            continue
        if document.get("kind") == "HorizontalPodAutoscaler":
            policies.append(policy_from_hpa(document))
        elif "policies" in document:
            policies += [policy_from_dict(item) for item in document["policies"]]
    if not policies:
        raise ValueError(f"{path}: no HorizontalPodAutoscaler and no 'policies' list")
    return policies
