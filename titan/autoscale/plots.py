"""One PNG comparing policies over time: traffic, ready replicas, P99 queueing delay (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window; must precede pyplot's import
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from titan.autoscale.report import Slo, windowed_p99  # noqa: E402
from titan.autoscale.simulator import SimulationResult  # noqa: E402
from titan.autoscale.traces import Arrival, rate_series  # noqa: E402

# Below this a log axis has nothing to show: the request went straight into a batch.
DELAY_FLOOR_S = 1e-3


def plot_comparison(results: Sequence[SimulationResult], arrivals: Sequence[Arrival], slo: Slo,
                    path: str | Path, window: float | None = None) -> Path:
    duration = results[0].duration
    window = window or max(10.0, duration / 150)
    minutes = 1 / 60
    figure, (traffic, replicas, delay) = plt.subplots(3, 1, figsize=(11, 9), sharex=True,
                                                       gridspec_kw={"height_ratios": [1, 1.3, 1.3]})
    centers, rates = rate_series(arrivals, duration, window)
    traffic.plot(centers * minutes, rates, color="0.3", linewidth=1)
    traffic.set_ylabel("arrivals (req/s)")
    traffic.set_title(f"Autoscaling policies under the same traffic ({window:g} s windows)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, result in enumerate(results):
        color = colors[index % len(colors)]
        times = np.array([sample.time for sample in result.samples])
        ready = np.array([sample.ready for sample in result.samples])
        desired = np.array([sample.decision.desired for sample in result.samples])
        replicas.step(times * minutes, ready, where="post", color=color, label=f"{result.policy.name} ready")
        replicas.step(times * minutes, desired, where="post", color=color, linestyle=":", linewidth=1)
        window_centers, p99 = windowed_p99(result, window)
        delay.plot(window_centers * minutes, np.maximum(p99, DELAY_FLOOR_S), color=color,
                   label=result.policy.name)
    replicas.set_ylabel("replicas (ready; dotted: desired)")
    replicas.legend(loc="upper left", fontsize="small")
    delay.set_yscale("log")
    delay.set_ylabel("P99 queueing delay (s)")
    if slo.queue_s is not None:
        delay.axhline(slo.queue_s, color="red", linestyle="--", linewidth=1, label=f"SLO {slo.queue_s:g} s")
    delay.legend(loc="upper left", fontsize="small")
    delay.set_xlabel("time (min)")
    for axis in (traffic, replicas, delay):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
