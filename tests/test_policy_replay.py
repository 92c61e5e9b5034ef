"""benchmarks/policy_replay.py: the scheduler replayed on a virtual clock, no model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    # No wall clock anywhere: the same command gives the same numbers.
    assert replay(tmp_path / "second.json")["draws"] == first["draws"]


def test_step_noise_changes_the_replay(tmp_path: Path) -> None:
    quiet = replay(tmp_path / "quiet.json")
    noisy = replay(tmp_path / "noisy.json", "--noise", "0.1")
    assert noisy["noise"] == 0.1
    assert noisy["draws"][0]["cells"]["storm@0.7"] != quiet["draws"][0]["cells"]["storm@0.7"]
