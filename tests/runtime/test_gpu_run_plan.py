"""``gpu_run.py --plan``: a planned GPU call picks its card's jobs by the card's name and shares one
budget among them, skipping (and saying so) a job whose fastest point no longer fits. The committed
plans name systems that ``gpu_serve`` can deploy and profiles that exist. No GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_run  # noqa: E402
from gpu_systems import parse  # noqa: E402

PLANS = sorted((REPO / "benchmarks" / "plans").glob("*.json"))
PLAN = {
    "requests": 300,
    "cards": [
        {"match": "H100", "profile": "p100.json", "jobs": [
            {"name": "a", "rates": "8.5", "systems": ["easerve:e1p1d1:b9:s0.5+mps85", "dynamo-style:e1p1d1+mps85"]},
            {"name": "b", "rates": "4,5", "systems": ["aggregated@2048"]},
        ]},
        {"match": "H200", "profile": "p200.json", "jobs": [{"name": "c", "rates": "10", "systems": ["easerve"]}]},
    ],
}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_card_is_picked_by_its_name_and_an_unplanned_card_is_refused() -> None:
    assert gpu_run.card_plan(PLAN, "GPU 0: NVIDIA H200 (UUID: GPU-1)")["profile"] == "p200.json"
    assert gpu_run.card_plan(PLAN, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2)")["profile"] == "p100.json"
    with pytest.raises(ValueError, match="no card matches 'NVIDIA A100'.*H100.*H200"):
        gpu_run.card_plan(PLAN, "NVIDIA A100")


def test_jobs_share_one_budget_and_one_that_cannot_serve_a_point_is_skipped() -> None:
    clock = Clock()
    served: list[tuple[str, list[str], float]] = []

    def serve(job: dict[str, Any], argv: list[str], left: float) -> int:
        served.append((job["name"], argv, left))
        clock.t += 450.0  # the first job takes most of the call
        return 0

    done = gpu_run.run_plan(PLAN, "NVIDIA H100 80GB HBM3", 550.0, serve, clock)
    # job b's fastest point is 300 requests at 5 req/s: 60 s, plus its start and gpu_serve's 30 s
    assert done == [{"job": "a", "rc": 0}, {"job": "b", "skipped": "budget", "need_s": 120, "left_s": 100}]
    (name, argv, left), = served
    assert (name, left) == ("a", 550.0)
    opts = dict(zip(argv[::2], argv[1::2], strict=True))
    assert opts["--profile-file"] == "p100.json" and opts["--rates"] == "8.5" and opts["--requests"] == "300"
    assert opts["--systems"] == "easerve:e1p1d1:b9:s0.5+mps85,dynamo-style:e1p1d1+mps85"
    assert float(opts["--budget-s"]) < left  # gpu_serve stops starting points inside the job's share
    assert opts["--out"].endswith("/a")

    clock.t, served[:] = 0.0, []
    done = gpu_run.run_plan(PLAN, "NVIDIA H100 80GB HBM3", 1000.0, serve, clock)
    assert [d.get("rc") for d in done] == [0, 0] and served[1][2] == 550.0  # what the first left


@pytest.mark.parametrize("path", PLANS, ids=[p.name for p in PLANS])
def test_committed_plans_name_deployable_systems_and_existing_profiles(path: Path) -> None:
    plan = json.loads(path.read_text())
    assert plan["cards"], path
    for card in plan["cards"]:
        assert (REPO / card["profile"]).is_file(), card["profile"]
        names = [job["name"] for job in card["jobs"]]
        assert len(set(names)) == len(names), names  # each job's JSON comes back under its own name
        for job in card["jobs"]:
            for system in job["systems"]:
                parse(system)  # raises, naming the wrong part, on a system gpu_serve cannot deploy
            assert gpu_run.job_seconds(job, int(plan.get("requests", 300))) < 550  # one point fits a call
