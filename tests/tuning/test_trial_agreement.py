"""The twin's prediction of a cluster trial (``tuning.agreement``, issue 13 must-hold 3): with two or
more frontends, each figure is the median over drawn rotation starts, as live frontends draw theirs."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from easerve_operator.tuning.agreement import START_DRAWS, twin_prediction
from easerve_operator.tuning.space import Alloc, Candidate, apply_candidate
from easerve_runtime.api import load_manifest
from easerve_runtime.metrics import observed_quantile
from easerve_runtime.policies.router import drawn_rotation_starts
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.systems import simulate_system
from easerve_runtime.topology import frontends_for
from easerve_runtime.workload.generate import generate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llava-v1.6-34b.yaml"

RATE, REQUESTS, SEED = 3.0, 120, 1


def _spec(encode: int, prefill: int, b: int, s: float):  # type: ignore[no-untyped-def]
    base = load_manifest(str(EXAMPLE))[1]
    return apply_candidate(base, Candidate(Alloc(encode, prefill, 2, 1, 2), b, s))


def test_the_prediction_of_a_trial_with_several_frontends_is_the_median_over_drawn_starts() -> None:
    spec = _spec(6, 0, 1, 0.0)  # the all-local trial: six encode pods, six frontends
    k = frontends_for(spec)
    assert k >= 2
    draws = drawn_rotation_starts(k, START_DRAWS)
    assert len(draws) == START_DRAWS and all(len(d) == k for d in draws)
    assert draws == drawn_rotation_starts(k, START_DRAWS)  # seeded: a prediction is reproducible
    reqs = generate(spec, RATE, REQUESTS, SEED)
    p99s, means = [], []
    for st in draws:
        r = simulate_system(spec, reqs, "easerve", cached_model(spec), frontends=k, frontend_starts=st)
        p99s.append(observed_quantile([x.ttft_s for x in r.records if x.ok], 0.99))
        means.append(float(r.summary["ttft_mean"]))
    p = twin_prediction(spec, RATE, REQUESTS, SEED)
    assert p["startDraws"] == START_DRAWS
    assert p["ttftP99Observed"] == pytest.approx(statistics.median(p99s))
    assert p["ttftMean"] == pytest.approx(statistics.median(means))
    assert p["ttftP99Range"] == [pytest.approx(min(p99s)), pytest.approx(max(p99s))]
    assert min(p99s) < max(p99s)  # the draw moves this trial's tail: why one draw would not do


def test_a_trial_with_one_frontend_is_predicted_from_one_run() -> None:
    spec = _spec(1, 1, 1, 1.0)
    assert frontends_for(spec) == 1
    p = twin_prediction(spec, RATE, REQUESTS, SEED)
    r = simulate_system(spec, generate(spec, RATE, REQUESTS, SEED), "easerve", cached_model(spec), frontends=1)
    assert p["startDraws"] == 0 and p["ttftMean"] == pytest.approx(float(r.summary["ttft_mean"]))
    assert p["ttftP99Range"][0] == p["ttftP99Range"][1] == p["ttftP99Observed"]
