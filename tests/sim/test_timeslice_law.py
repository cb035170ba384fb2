"""``benchmarks/timeslice_law.py``'s CPU half: what the twin's time-slicing rule and processor
sharing predict for the two streams the GPU half measures (a decode loop against prefill bursts),
and its plot. No GPU: the measured figures here are the committed run's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import timeslice_law as tl  # noqa: E402


def test_a_saturated_pair_halves_both_sides_under_processor_sharing() -> None:
    """Back to back prefill (duty 1) against a decode loop with no host pause: both always busy,
    so processor sharing doubles both, and the twin's rule charges the same."""
    ps = tl.twin_rule(10.0, 0.0, 60.0, 1.0, 3000.0, 0, sharing="ps")
    assert ps["decode_dilation"] == pytest.approx(2.0, abs=0.02)
    assert ps["prefill_dilation"] == pytest.approx(2.0, abs=0.02)
    rule = tl.twin_rule(10.0, 0.0, 60.0, 1.0, 20000.0, 0)
    assert rule["decode_dilation"] == pytest.approx(2.0, abs=0.02) and rule["prefill_dilation"] == pytest.approx(2.0)


def test_the_decode_loops_host_pause_leaves_the_gpu_to_the_prefill_under_sharing() -> None:
    """With a host pause after each step the decode loop holds the GPU part of the time, so under
    processor sharing a saturated prefill slows by less than 2x; the twin's rule, which counts the
    pause as busy, still charges 2x (the difference the GPU run measures)."""
    ps = tl.twin_rule(9.4, 2.0, 77.0, 1.0, 3000.0, 0, sharing="ps")
    rule = tl.twin_rule(9.4, 2.0, 77.0, 1.0, 20000.0, 0)
    assert 1.7 < ps["prefill_dilation"] < 1.95
    assert rule["prefill_dilation"] == pytest.approx(2.0)


def test_a_light_prefill_stream_slows_decode_in_proportion_to_its_duty() -> None:
    light = tl.twin_rule(9.4, 2.0, 77.0, 0.2, 20000.0, 1)
    heavy = tl.twin_rule(9.4, 2.0, 77.0, 0.8, 20000.0, 1)
    assert 1.0 < light["decode_dilation"] < heavy["decode_dilation"] <= 2.0


def test_the_committed_run_gets_its_predictions_and_a_plot(tmp_path: Path) -> None:
    run = json.loads((REPO / "benchmarks" / "results" / "timeslice_law_h200_run13.json").read_text())
    for p in run["points"]:
        p.pop("twin_rule", None), p.pop("processor_sharing", None)
    out = tl.with_predictions(run)
    assert all({"twin_rule", "processor_sharing"} <= p.keys() for p in out["points"])
    png = tmp_path / "law.png"
    tl.plot(out, png)
    assert png.stat().st_size > 10_000
