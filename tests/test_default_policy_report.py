"""benchmarks/default_policy.py's bookkeeping: which arrivals each cell draws, and where its token gaps come from
(its steps.json)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from default_policy import LOADS, PRESETS, cell_number, gap_sources, interval_note, server_order  # noqa: E402


def test_a_cell_draws_the_full_runs_arrivals_whichever_cells_run_beside_it() -> None:
    # the full default grid, preset by preset: the numbering (and so every seed) the full runs have used
    assert [cell_number(preset, load) for preset in PRESETS for load in LOADS] == list(range(1, 9))
    # `--presets storm --loads 0.7` runs the full run's storm@0.7, not its first cell's seed
    assert cell_number("storm", 0.7) == 5
    # other loads number past the grid, one apart per tenth of load, no two cells alike
    extra = [cell_number(preset, load) for preset in PRESETS for load in (0.5, 1.0, 2.0)]
    assert len(set(extra)) == len(extra) and min(extra) > len(PRESETS) * len(LOADS)


def step(duration: float, decodes: int, prefill: int) -> dict[str, float | int]:
    return {"duration": duration, "num_decodes": decodes, "num_prefill_tokens": prefill}


def test_each_step_makes_one_gap_per_decode_and_prefill_only_steps_make_none() -> None:
    steps = ([step(0.010, 2, 0)] * 30  # 60 gaps from decode-only steps
             + [step(0.025, 1, 5)] * 20  # 20 from steps that also prefill
             + [step(0.500, 0, 300)] * 5)  # a prompt alone: nobody's gap
    sources = gap_sources(steps)
    assert sources["decode_only_gap_share"] == pytest.approx(60 / 80)
    assert sources["decode_only_p99_over_p50"] == pytest.approx(1.0)


def test_the_scatter_is_that_of_the_decode_only_steps_alone() -> None:
    # 100 decode-only steps of 10..109 ms: P50 59.5 ms, P99 108.01 ms (interpolated, as the ITL rule's
    # percentiles are); the slow prefilling steps do not count
    steps = [step((10 + i) / 1000, 1, 0) for i in range(100)] + [step(1.0, 3, 64)] * 10
    sources = gap_sources(steps)
    assert sources["decode_only_gap_share"] == pytest.approx(100 / 130)
    assert sources["decode_only_p99_over_p50"] == pytest.approx(108.01 / 59.5)


def test_no_decodes_no_share_and_too_few_steps_no_scatter() -> None:
    assert gap_sources([step(0.3, 0, 100)]) == {"decode_only_gap_share": None, "decode_only_p99_over_p50": None}
    few = gap_sources([step(0.01, 1, 0)] * 5 + [step(0.03, 1, 4)] * 5)
    assert few == {"decode_only_gap_share": 0.5, "decode_only_p99_over_p50": None}


def test_a_rule_says_when_another_draw_could_flip_it() -> None:
    assert interval_note(None, 2.0) == ""
    wide = {"estimate": 2.2, "low": 1.85, "high": 2.47, "level": 0.9}
    assert interval_note(wide, 2.0) == "; 90% interval 1.85-2.47, either side of 2: another draw could flip it"
    assert interval_note(wide | {"low": 2.05}, 2.0) == "; 90% interval 2.05-2.47"


def test_each_load_and_each_preset_has_both_server_orders() -> None:
    firsts = {(preset, load): server_order(preset, load)[0] for preset in PRESETS for load in LOADS}
    for load in LOADS:
        assert sorted(firsts[preset, load] for preset in PRESETS) == ["candidate", "candidate", "fcfs", "fcfs"]
    for preset in PRESETS:
        assert {firsts[preset, load] for load in LOADS} == {"candidate", "fcfs"}
    assert all(sorted(server_order(preset, 1.0)) == ["candidate", "fcfs"] for preset in PRESETS)
