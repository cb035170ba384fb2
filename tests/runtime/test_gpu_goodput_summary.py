"""``benchmarks/gpu_goodput.py --summary``: the parts of one committed GPU run merged into one table,
its best-over-rates goodput and ratios recomputed here from the raw points of the committed files.
No GPU; nothing here asserts a measured value, only that the summary says what the files say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_goodput.py"


def summary(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), "--summary", *args], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return json.loads(out.stdout)


def test_the_summary_merges_every_part_of_a_run_and_its_ratios_follow_the_points() -> None:
    s = summary("--run", "run9")
    raw: dict[str, dict[float, float]] = {}
    for f in s["files"]:
        for name, sys_ in json.loads((REPO / f).read_text())["systems"].items():
            for p in sys_.get("points", []):
                raw.setdefault(name, {})[p["rate"]] = p["goodput"]["moderate"]
    assert set(s["systems"]) == set(raw)
    assert s["rates"] == sorted({r for pts in raw.values() for r in pts})
    for name, pts in raw.items():
        assert s["systems"][name]["best_moderate"] == round(max(pts.values()), 3)
    ours = max(("easerve", "easerve-own-process"), key=lambda n: max(raw.get(n, {0: 0.0}).values()))
    assert s["ratios"]["easerve_layout"] == ours
    for base in ("dynamo-style", "aggregated"):
        want = round(max(raw[ours].values()) / max(raw[base].values()), 2)
        assert s["ratios"][f"best_over_rates easerve/{base}"] == want
        for rate, ratio in s["ratios"][f"per_rate easerve/{base}"].items():
            best_ours = max(raw[n][float(rate)] for n in ("easerve", "easerve-own-process") if float(rate) in raw[n])
            assert ratio == round(best_ours / raw[base][float(rate)], 2)


def test_has_hardwares_deploys_count_as_parts_of_their_run() -> None:
    """From run 10 on the 300-request points come from ``has_hardware.py --deploy`` (the same
    ``gpu_serve.py`` runs): they merge as a run's parts like ``gpu_serve_h200_*_300req`` files."""
    s = summary("--run", "run13")
    assert s["files"] and all(Path(f).name.startswith("has_hardware_h200_run13") for f in s["files"])
    names = {n for f in s["files"] for n in json.loads((REPO / f).read_text())["systems"]}
    assert set(s["systems"]) == names
    assert s["ratios"]["easerve_layout"].startswith("easerve:")


def test_an_unknown_run_is_refused_naming_the_runs_on_record() -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        summary("--run", "run999")
    assert "run999" in err.value.stderr and "run9" in err.value.stderr


def point(rate: float, moderate: float) -> dict:
    return {"rate": rate, "goodput": {"moderate": moderate, "strict": 0.0}, "throughput": rate, "ttft_p99": 1.0,
            "tpot_mean": 0.02, "tpot_p99": 0.03}


def test_a_baselines_configurations_count_as_its_sweep_and_the_best_one_is_compared(tmp_path: Path) -> None:
    """Synthetic parts of one run: the aggregated baseline at two token budgets, in two files."""
    (tmp_path / "gpu_serve_h200_run42_300req.json").write_text(json.dumps({"systems": {
        "easerve": {"points": [point(2.0, 1.8), point(4.0, 3.0)]},
        "aggregated": {"points": [point(2.0, 1.9), point(4.0, 1.5)]},
    }}))
    (tmp_path / "gpu_serve_h200_run42b_300req.json").write_text(json.dumps({"systems": {
        "aggregated@4096": {"points": [point(2.0, 1.2), point(4.0, 2.0)]},
    }}))
    s = summary("--results", str(tmp_path))
    assert s["run"] == "run42" and s["rates"] == [2.0, 4.0]
    sw = s["baselines_swept"]["aggregated"]
    assert sw["configurations"] == ["aggregated", "aggregated@4096"]
    assert sw["best_per_rate"] == {"2.0": "aggregated", "4.0": "aggregated@4096"}
    assert sw["best_over_rates"] == "aggregated@4096"  # 2.0 beats 1.9
    assert s["ratios"]["per_rate easerve/aggregated"] == {"2.0": round(1.8 / 1.9, 2), "4.0": 1.5}
    assert s["ratios"]["best_over_rates easerve/aggregated"] == 1.5


def test_repeats_count_as_their_mean_and_runs_merge(tmp_path: Path) -> None:
    """A point measured in two runs (run 15 repeated run 14's at 7 req/s) is their mean, each
    repeat listed; ``--run run41,run42`` merges both runs' parts."""
    (tmp_path / "gpu_serve_h200_run41_300req.json").write_text(json.dumps({"systems": {
        "easerve": {"points": [point(7.0, 6.7)]},
        "dynamo-style": {"points": [point(7.0, 6.4)]},
    }}))
    (tmp_path / "gpu_serve_h200_run42_300req.json").write_text(json.dumps({"systems": {
        "easerve": {"points": [point(7.0, 5.5), point(8.5, 4.0)]},
    }}))
    s = summary("--results", str(tmp_path), "--run", "run41,run42")
    e = s["systems"]["easerve"]
    assert e["goodput"]["moderate"] == {"7.0": round((6.7 + 5.5) / 2, 3), "8.5": 4.0}
    assert e["repeats_moderate"] == {"7.0": [6.7, 5.5]}
    assert s["ratios"]["per_rate easerve/dynamo-style"] == {"7.0": round(6.1 / 6.4, 2)}
    assert "repeats_moderate" not in s["systems"]["dynamo-style"]
    assert summary("--results", str(tmp_path), "--run", "run42")["systems"]["easerve"]["goodput"]["moderate"]["7.0"] == 5.5


def test_a_repeats_stage_counters_are_the_mean_of_its_repeats_level_by_level() -> None:
    """The workers' counters nest (``prefill.prefill.engine_over_profile``): a repeated point's are
    the mean of its repeats' at every level, as its goodput is, not its first repeat's; what is not
    a number (a label) stays the first's. The stage-scored MPS fit reads these counters."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_serve import mean_of_repeats

    a = {**point(10.0, 9.0), "encode": {"engine_over_profile": 1.8, "batches": 300, "backend": "mps"},
         "prefill": {"prefill": {"engine_over_profile": 1.2, "ms": {"p50": 290.0}}}}
    b = {**point(10.0, 8.0), "encode": {"engine_over_profile": 2.2, "batches": 280, "backend": "mps"},
         "prefill": {"prefill": {"engine_over_profile": 1.4, "ms": {"p50": 310.0}}}}
    m = mean_of_repeats([a, b])
    assert m["goodput"]["moderate"] == 8.5
    assert m["encode"] == {"engine_over_profile": 2.0, "batches": 290.0, "backend": "mps"}
    assert m["prefill"]["prefill"]["engine_over_profile"] == pytest.approx(1.3)
    assert m["prefill"]["prefill"]["ms"] == {"p50": 300.0}
    assert [r["goodput_moderate"] for r in m["repeats"]] == [9.0, 8.0]
    assert a["encode"]["engine_over_profile"] == 1.8  # the repeats themselves untouched


def test_the_default_summary_reads_the_current_setups_runs_not_only_the_newest() -> None:
    """Run 17 holds only plans and repeats at two rates: alone it would compare a few systems at one
    rate, so the committed default is the current setup's runs merged."""
    s = summary()
    assert s["run"] == "run14,run15,run17"
    assert {Path(f).name.split("_")[3][:5] for f in s["files"]} == {"run14", "run15", "run17"}
    assert "best_over_rates easerve/aggregated" in s["ratios"]


def test_points_on_record_that_measured_something_else_are_left_out_and_named() -> None:
    """Run 18 (one H100): three points of part b ran with 8 KV slots (the decode sized its KV after
    its card-mates had loaded); the summary takes those systems from the other parts only, keeps
    part b's aggregated point, and says what it left out and why."""
    s = summary("--run", "run18")
    raw = json.loads((REPO / "benchmarks/results/gpu_serve_h100_run18b_300req.json").read_text())
    left_out = {e["system"] for e in s["excluded"]}
    assert left_out == {"dynamo-style:e1p1d1+mps85", "easerve:e1p0d1:b6:s0+mps85", "easerve:e1p0d1:b1:s0+mps85"}
    assert all("KV slots" in e["why"] and "loaded first" in e["why"] for e in s["excluded"])
    later = json.loads((REPO / "benchmarks/results/gpu_serve_h100_run18c_300req.json").read_text())
    dyn = "dynamo-style:e1p1d1+mps85"
    assert s["systems"][dyn]["parts"] == ["gpu_serve_h100_run18c_300req.json@5.5"]
    want = [p for p in later["systems"][dyn]["points"] if p["rate"] == 5.5][0]["goodput"]["moderate"]
    assert s["systems"][dyn]["goodput"]["moderate"]["5.5"] == round(want, 3)
    assert any(p.startswith("gpu_serve_h100_run18b") for p in s["systems"]["aggregated@2048"]["parts"])
    assert "aggregated@2048" in raw["systems"]
