"""benchmarks/policy_replay.py: the scheduler replayed on a virtual clock, no model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
from policy_replay import BUSIEST_WINDOW_S, Replay, Replayed, busiest_load, work_seconds  # noqa: E402

from titan.engine.cost_model import StepShape  # noqa: E402


def replay(output: Path, *extra: str) -> dict:
    subprocess.run([sys.executable, "benchmarks/policy_replay.py", "--presets", "burst,storm", "--loads", "0.7",
                    "--seeds", "2", "--duration", "10", "--calibration-requests", "8", "--output", str(output),
                    *extra], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(output.read_text())


def test_a_replay_serves_every_request_under_both_policies_and_repeats_exactly(tmp_path: Path) -> None:
    first = replay(tmp_path / "first.json")
    assert first["seeds"] == 2 and len(first["draws"]) == 2
    for draw in first["draws"]:
        for key in ("burst@0.7", "storm@0.7"):
            cell = draw["cells"][key]
            # the same requests to both, every one of them answered with its first token and its gaps
            assert cell["candidate"]["requests"] == cell["fcfs"]["requests"] > 0
            assert cell["candidate"]["ttft_ms"]["count"] == cell["candidate"]["requests"]
            assert cell["candidate"]["itl_ms"]["count"] > 0
    # The two draws are different arrivals; the targets are default_policy.py's, counted per draw.
    assert first["draws"][0]["cells"] != first["draws"][1]["cells"]
    assert set(first["pass_counts"]) >= {"burst@0.7: TTFT P99 <= 1.1 x fcfs", "storm@0.7: ITL P99 <= 2 x P50"}
    # Each target's draws are split by whether the cell's busiest window stayed within capacity.
    for name, sides in first["pass_counts_by_load"].items():
        assert sum(total for _, total in sides.values()) == 2
        assert sum(passed for passed, _ in sides.values()) == first["pass_counts"][name]
    for draw in first["draws"]:
        assert all(cell["busiest_load"] > 0 for cell in draw["cells"].values())
    # Each cell's TTFT, goodput and throughput over the draws sit beside the pass counts.
    assert set(first["cells"]) == {"burst@0.7", "storm@0.7"}
    for key, summary in first["cells"].items():
        for name in ("candidate", "fcfs"):
            assert summary[name]["good"] == sum(draw["cells"][key][name]["good"] for draw in first["draws"])
            assert 0 < summary[name]["ttft_p50_ms"] <= summary[name]["ttft_p99_ms"]
        tok_s = [sum(draw["cells"][key][name]["output_tok_s"] for draw in first["draws"])
                 for name in ("candidate", "fcfs")]
        assert summary["output_tok_s_vs_fcfs"] == pytest.approx(tok_s[0] / tok_s[1])
    # No wall clock anywhere: the same command gives the same numbers.
    assert replay(tmp_path / "second.json")["draws"] == first["draws"]


def test_step_noise_changes_the_replay(tmp_path: Path) -> None:
    quiet = replay(tmp_path / "quiet.json")
    noisy = replay(tmp_path / "noisy.json", "--noise", "0.1")
    assert noisy["noise"] == 0.1
    assert noisy["draws"][0]["cells"]["storm@0.7"] != quiet["draws"][0]["cells"]["storm@0.7"]


def test_correlated_noise_keeps_its_sigma_and_carries_into_the_next_step() -> None:
    """Served steps' scatter comes in slow spells: --noise-correlation makes it an AR(1) in log space whose
    lag-1 correlation is the flag, with the same sigma as independent steps (4,000 steps, seeded)."""
    shape = StepShape().plus(1, 100).plus(32, 0)

    def log_scatter(correlation: float) -> np.ndarray:
        replay = Replay("fcfs", (2.9, 1.65, 1.33, 0.0), 0.15, 64, 7, correlation)
        base = Replay("fcfs", (2.9, 1.65, 1.33, 0.0), 0.0, 64, 7).seconds(shape)
        return np.log(np.array([replay.seconds(shape) for _ in range(4000)]) / base)

    for correlation in (0.0, 0.7):
        scatter = log_scatter(correlation)
        assert scatter.std() == pytest.approx(0.15, rel=0.1)
        assert np.corrcoef(scatter[:-1], scatter[1:])[0, 1] == pytest.approx(correlation, abs=0.05)


def test_the_busiest_window_is_the_most_work_arriving_in_any_window_over_capacity() -> None:
    law = (2.9, 2.0, 1.0, 0.0)  # ms: a prompt token costs 2, an output token 2 + 1
    one = Replayed(0, 0.0, list(range(100)), 10)
    assert work_seconds(one, law) == pytest.approx((100 * 2.0 + 10 * 3.0) / 1000.0)
    # three requests close together, a fourth a whole window later: the busiest window holds three
    dues = [0.0, 1.0, 2.0, 2.0 + BUSIEST_WINDOW_S]
    requests = [Replayed(i, due, list(range(100)), 10) for i, due in enumerate(dues)]
    capacity = 0.05  # work seconds served per second
    assert busiest_load(requests, law, capacity) == pytest.approx(3 * 0.23 / (BUSIEST_WINDOW_S * capacity))
    assert busiest_load([], law, capacity) == 0.0
