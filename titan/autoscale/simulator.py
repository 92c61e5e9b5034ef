"""Discrete-event simulation of a Titan Deployment under an HPA.

What is modelled, and why:
- Replicas batch continuously: the n requests a replica runs share it, each advancing at 1/latency(n) of its
  work per second (`CapacityProfile`); past `max_concurrency` requests wait in the replica's own queue, which
  is what `titan:num_requests_waiting` counts. Per replica a virtual clock keeps this O(log n) per event.
- Routing is to the ready replica with the fewest requests (`least-load`, what `titan router` does) or to a
  random one (`random`, like a plain Service). With no replica ready, requests wait at the front door.
- A new pod is ready `cold_start_s` after the HPA asks for it. Pods removed on scale-down stop getting
  requests at once, finish what they hold, and are gone when empty or after `drain_timeout_s`, aborting the
  rest (the `--drain-timeout` of `titan serve`). Removal order follows the ReplicaSet: pods not yet ready
  first (newest first), then the most recently ready.
- Metrics are scraped every `scrape_interval_s`; the HPA reads, every `sync_period_s`, each metric's mean
  over its window up to the last scrape. Pods still starting have no Titan series yet (its /metrics is
  empty until the model is loaded), so the controller treats them as missing; for CPU they are not ready,
  and stay ignored until one metric window after they became ready, as in the controller.
Cost (replica-seconds) counts every pod that exists (starting, ready or draining) until the trace ends.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from titan.autoscale.capacity import CapacityProfile
from titan.autoscale.hpa import (
    Decision,
    HorizontalPodAutoscaler,
    PodMetrics,
    metric_replicas,
    proposal_over_metrics,
)
from titan.autoscale.policies import MetricTarget, Policy
from titan.autoscale.traces import Arrival

Routing = Literal["least-load", "random"]
# CPU utilization of a replica: "batch" = the share of its batch in use (a CPU-bound server); "busy" = the
# share of time it runs anything at all (a GPU server, whose engine loop keeps a core busy at any load).
CpuModel = Literal["batch", "busy"]
# Tie-break order of simultaneous events: capacity appears and frees up before new load is routed.
READY, COMPLETION, DRAIN_DEADLINE, SCRAPE, SYNC = range(5)


@dataclass(frozen=True)
class SimulationConfig:
    cold_start_s: float = 30.0
    sync_period_s: float = 15.0
    scrape_interval_s: float = 15.0
    drain_timeout_s: float = 25.0
    routing: Routing = "least-load"
    cpu_model: CpuModel = "batch"
    initial_replicas: int | None = None  # default: the policy's minReplicas, ready at time 0
    seed: int = 0


@dataclass
class Replica:
    id: int
    created: float
    ready_at: float | None = None
    state: str = "starting"  # starting | ready | draining | gone
    running: list[tuple[float, int]] = field(default_factory=list)  # heap of (virtual finish, request)
    waiting: deque[int] = field(default_factory=deque)
    virtual: float = 0.0
    clock: float = 0.0
    version: int = 0
    area_running: float = 0.0  # integrals over time, for window averages
    area_waiting: float = 0.0
    area_busy: float = 0.0
    snapshot_times: list[float] = field(default_factory=list)
    snapshots: list[tuple[float, float, float, int, int]] = field(default_factory=list)  # areas, then counts

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass(frozen=True)
class SyncSample:
    time: float
    ready: int
    starting: int
    draining: int
    metric_values: tuple[float | None, ...]  # fleet mean of each metric as the HPA read it
    decision: Decision


@dataclass
class SimulationResult:
    policy: Policy
    duration: float
    arrival: np.ndarray
    admitted: np.ndarray  # entered a batch (NaN: never)
    finished: np.ndarray
    aborted: np.ndarray  # bool: cut by a drain timeout
    samples: list[SyncSample]
    replica_seconds: float
    max_concurrency: int

    @property
    def queue_delay(self) -> np.ndarray:
        return self.admitted - self.arrival

    @property
    def latency(self) -> np.ndarray:
        return self.finished - self.arrival


class Simulation:
    def __init__(self, arrivals: Sequence[Arrival], capacity: CapacityProfile, policy: Policy,
                 config: SimulationConfig, duration: float) -> None:
        self.arrivals, self.capacity, self.policy, self.config = arrivals, capacity, policy, config
        self.duration = duration
        count = len(arrivals)
        self.work = [arrival.work for arrival in arrivals]
        self.admitted = [math.nan] * count
        self.finished = [math.nan] * count
        self.aborted = [False] * count
        self.replicas: list[Replica] = []
        self.active: dict[int, Replica] = {}  # every replica not gone, by id
        # Snapshots older than the longest window are never read again.
        longest_window = max(metric.window_s for metric in policy.metrics)
        self.snapshot_horizon = longest_window + 2 * config.scrape_interval_s
        self.front_door: deque[int] = deque()
        self.events: list[tuple[float, int, int, int, int]] = []  # (time, order, sequence, replica, version)
        self.sequence = 0
        self.hpa = HorizontalPodAutoscaler(policy.hpa)
        self.samples: list[SyncSample] = []
        self.last_scrape = 0.0
        self.rng = np.random.default_rng(config.seed)
        self.replica_seconds = 0.0
        self.cost_clock = 0.0
        self.outstanding = 0

    # ---- events ------------------------------------------------------------------------------
    def push(self, time: float, order: int, replica: int = -1, version: int = 0) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (time, order, self.sequence, replica, version))

    def run(self) -> SimulationResult:
        initial = self.config.initial_replicas or self.policy.hpa.min_replicas
        for _ in range(initial):
            replica = self.add_replica(0.0)
            replica.state, replica.ready_at = "ready", 0.0
        self.scrape(0.0)
        self.push(self.config.scrape_interval_s, SCRAPE)
        self.push(self.config.sync_period_s, SYNC)
        next_arrival = 0
        while next_arrival < len(self.arrivals) or self.outstanding:
            event_time = self.events[0][0] if self.events else math.inf
            if next_arrival < len(self.arrivals) and self.arrivals[next_arrival].time < event_time:
                self.account_cost(self.arrivals[next_arrival].time)
                self.route(next_arrival, self.arrivals[next_arrival].time)
                next_arrival += 1
                continue
            time, order, _, replica_id, version = heapq.heappop(self.events)
            self.account_cost(time)
            if order == COMPLETION:
                replica = self.replicas[replica_id]
                if version == replica.version:
                    self.complete(replica, time)
            elif order == READY:
                self.on_ready(self.replicas[replica_id], time)
            elif order == DRAIN_DEADLINE:
                self.abort_all(self.replicas[replica_id], time)
            elif order == SCRAPE:
                self.scrape(time)
                self.push(time + self.config.scrape_interval_s, SCRAPE)
            elif order == SYNC:
                self.sync(time)
                self.push(time + self.config.sync_period_s, SYNC)
        self.account_cost(self.duration)
        return SimulationResult(
            self.policy, self.duration, np.array([a.time for a in self.arrivals]), np.array(self.admitted),
            np.array(self.finished), np.array(self.aborted, dtype=bool), self.samples, self.replica_seconds,
            self.capacity.max_concurrency,
        )

    def account_cost(self, time: float) -> None:
        until = min(time, self.duration)
        if until > self.cost_clock:
            self.replica_seconds += len(self.active) * (until - self.cost_clock)
            self.cost_clock = until

    # ---- a replica's batch -------------------------------------------------------------------------
    def advance(self, replica: Replica, time: float) -> None:
        elapsed = time - replica.clock
        if elapsed > 0:
            running = len(replica.running)
            if running:
                replica.virtual += elapsed / self.capacity.latency_at(running)
            replica.area_running += running * elapsed
            replica.area_busy += elapsed if running else 0.0
            replica.area_waiting += len(replica.waiting) * elapsed
            replica.clock = time

    def reschedule(self, replica: Replica, time: float) -> None:
        replica.version += 1
        if replica.running:
            remaining = replica.running[0][0] - replica.virtual
            delay = max(0.0, remaining) * self.capacity.latency_at(len(replica.running))
            self.push(time + delay, COMPLETION, replica.id, replica.version)

    def admit(self, replica: Replica, request: int, time: float) -> None:
        self.admitted[request] = time
        heapq.heappush(replica.running, (replica.virtual + self.work[request], request))

    def enqueue(self, replica: Replica, request: int, time: float) -> None:
        self.advance(replica, time)
        if len(replica.running) < self.capacity.max_concurrency:
            self.admit(replica, request, time)
            self.reschedule(replica, time)
        else:
            replica.waiting.append(request)

    def complete(self, replica: Replica, time: float) -> None:
        self.advance(replica, time)
        _, request = heapq.heappop(replica.running)
        self.finished[request] = time
        self.outstanding -= 1
        while replica.waiting and len(replica.running) < self.capacity.max_concurrency:
            self.admit(replica, replica.waiting.popleft(), time)
        self.reschedule(replica, time)
        if replica.state == "draining" and not replica.load:
            self.retire(replica)

    def abort_all(self, replica: Replica, time: float) -> None:
        if replica.state != "draining":
            return
        self.advance(replica, time)
        for request in [request for _, request in replica.running] + list(replica.waiting):
            self.finished[request], self.aborted[request] = time, True
            if math.isnan(self.admitted[request]):
                self.admitted[request] = time
            self.outstanding -= 1
        replica.running.clear()
        replica.waiting.clear()
        replica.version += 1
        self.retire(replica)

    # ---- routing and the fleet ---------------------------------------------------------------------
    def ready_replicas(self) -> list[Replica]:
        return [replica for replica in self.active.values() if replica.state == "ready"]

    def live_replicas(self) -> list[Replica]:
        """The pods the Deployment counts: starting or ready (draining pods are terminating)."""
        return [replica for replica in self.active.values() if replica.state != "draining"]

    def retire(self, replica: Replica) -> None:
        replica.state = "gone"
        self.active.pop(replica.id, None)

    def route(self, request: int, time: float) -> None:
        self.outstanding += 1
        ready = self.ready_replicas()
        if not ready:
            self.front_door.append(request)
            return
        if self.config.routing == "random":
            target = ready[int(self.rng.integers(len(ready)))]
        else:
            target = min(ready, key=lambda replica: (replica.load, replica.id))
        self.enqueue(target, request, time)

    def add_replica(self, time: float) -> Replica:
        replica = Replica(len(self.replicas), time, clock=time)
        self.replicas.append(replica)
        self.active[replica.id] = replica
        return replica

    def on_ready(self, replica: Replica, time: float) -> None:
        if replica.state != "starting":
            return
        replica.state, replica.ready_at = "ready", time
        self.advance(replica, time)
        waiting, self.front_door = self.front_door, deque()
        self.outstanding -= len(waiting)
        for request in waiting:
            self.route(request, time)

    def scale(self, desired: int, time: float) -> None:
        live = self.live_replicas()
        for _ in range(desired - len(live)):
            replica = self.add_replica(time)
            self.push(time + self.config.cold_start_s, READY, replica.id)
        if desired >= len(live):
            return
        # The ReplicaSet deletes pods that are not ready first, then those ready for the shortest time.
        victims = sorted(live, key=lambda r: (r.state == "ready", -(r.ready_at or 0.0), -r.created, -r.id))
        for replica in victims[: len(live) - desired]:
            if replica.state == "starting" or not replica.load:
                self.retire(replica)
            else:
                replica.state = "draining"
                self.push(time + self.config.drain_timeout_s, DRAIN_DEADLINE, replica.id)

    # ---- metrics and the HPA -----------------------------------------------------------------------
    def scrape(self, time: float) -> None:
        for replica in self.active.values():
            self.advance(replica, time)
            replica.snapshot_times.append(time)
            replica.snapshots.append((replica.area_running, replica.area_waiting, replica.area_busy,
                                      len(replica.running), len(replica.waiting)))
            stale = bisect.bisect_left(replica.snapshot_times, time - self.snapshot_horizon)
            if stale > 64:  # trim in chunks: deleting from a list's head is linear
                del replica.snapshot_times[:stale], replica.snapshots[:stale]
        self.last_scrape = time

    def pod_value(self, replica: Replica, metric: MetricTarget) -> float:
        """The metric's mean over its window up to the last scrape (the snapshot value if no window fits).
        Only samples since the pod became ready count: before that it exported no series."""
        times, snapshots = replica.snapshot_times, replica.snapshots
        window_start = max(times[-1] - metric.window_s, replica.ready_at or 0.0)
        first = bisect.bisect_left(times, window_start - 1e-9)
        start, end = snapshots[first], snapshots[-1]
        span = times[-1] - times[first]
        if span > 0:
            running, waiting, busy = ((end[index] - start[index]) / span for index in range(3))
        else:
            running, waiting, busy = float(end[3]), float(end[4]), float(end[3] > 0)
        if metric.type == "cpu":
            if self.config.cpu_model == "busy":
                return 100.0 * busy
            return 100.0 * running / self.capacity.max_concurrency
        return {"waiting": waiting, "running": running, "inflight": running + waiting}[metric.type]

    def pod_metrics(self, metric: MetricTarget) -> PodMetrics:
        values, unready, missing = [], 0, 0
        for replica in self.live_replicas():
            has_value = (replica.state == "ready" and bool(replica.snapshot_times)
                         and replica.snapshot_times[-1] >= (replica.ready_at or 0.0))
            if metric.type != "cpu":
                if has_value:
                    values.append(self.pod_value(replica, metric))
                else:
                    missing += 1
                continue
            # CPU samples count once the pod is ready and a whole window has passed since.
            ready_at = replica.ready_at or 0.0
            if has_value and (ready_at == 0.0 or ready_at + metric.window_s <= self.last_scrape):
                values.append(self.pod_value(replica, metric))
            else:
                unready += 1
        return PodMetrics(values, num_unready=unready, num_missing=missing)

    def sync(self, time: float) -> None:
        live = self.live_replicas()
        current = len(live)
        proposals, means = [], []
        for metric in self.policy.metrics:
            observed = self.pod_metrics(metric)
            means.append(sum(observed.values) / len(observed.values) if observed.values else None)
            proposals.append(metric_replicas(observed, metric.target, current, metric.kind,
                                             self.policy.hpa.tolerance))
        decision = self.hpa.reconcile(time, current, proposal_over_metrics(proposals, current))
        ready = sum(1 for replica in live if replica.state == "ready")
        draining = len(self.active) - current
        self.samples.append(SyncSample(time, ready, current - ready, draining, tuple(means), decision))
        if decision.desired != current:
            self.scale(decision.desired, time)


def simulate(arrivals: Sequence[Arrival], capacity: CapacityProfile, policy: Policy, config: SimulationConfig,
             duration: float) -> SimulationResult:
    return Simulation(arrivals, capacity, policy, config, duration).run()
