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


def test_an_unknown_run_is_refused_naming_the_runs_on_record() -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        summary("--run", "run999")
    assert "run999" in err.value.stderr and "run9" in err.value.stderr
