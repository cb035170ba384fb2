"""HAS's entry points on the twin: the trial runner's dict and the stage profiler's probes."""

from __future__ import annotations

import pytest
from easerve_runtime.sim.profiler import SATURATION_GAIN, SimProfiler
from easerve_runtime.sim.runner import run_trial
from toy import ToyProfile

TRIAL_KEYS = {
    "throughput",
    "goodput",
    "ttft_mean",
    "tpot_mean",
    "ttft_p99",
    "tpot_p99",
    "completed",
    "cost_s",
}


def test_run_trial_has_trialmetrics_keys_and_is_deterministic(llava_spec) -> None:
    a = run_trial(llava_spec, 2.0, 60, seed=4)
    b = run_trial(llava_spec, 2.0, 60, seed=4)
    assert set(a) >= TRIAL_KEYS
    assert set(a["goodput"]) == {t.name for t in llava_spec.slo.tiers}
    assert a["completed"] == 60 and a["cost_s"] > 0
    a.pop("cpu_s"), b.pop("cpu_s")
    assert a == b


def test_has_trials_pass_the_deployments_front_door(llava_spec) -> None:
    """HAS's twin trials admit as the deployment's frontends do (one per encode pod): past the
    candidate's capacity they refuse requests, as the pods would, instead of scoring a queue the
    live frontends never let form. ``frontends=0`` opens the door."""
    from easerve_runtime.sim.runner import cached_model
    from easerve_runtime.sim.systems import simulate_system
    from easerve_runtime.topology import frontends_for
    from easerve_runtime.workload.generate import generate

    door = run_trial(llava_spec, 5.0, 200, 1)
    want = simulate_system(llava_spec, generate(llava_spec, 5.0, 200, 1), "easerve", cached_model(llava_spec),
                           frontends=frontends_for(llava_spec)).summary
    assert (door["completed"], door["failed"], door["ttft_p99"]) == (want["completed"], want["failed"], want["ttft_p99"])
    open_door = run_trial(llava_spec, 5.0, 200, 1, frontends=0)
    assert open_door["failed"] == 0 and open_door["completed"] == 200
    assert door["failed"] > 0 and door["completed"] + door["failed"] == 200
    # what it admits meets the tier more often than the queue an open door lets form
    assert door["goodput"]["moderate"] > open_door["goodput"]["moderate"]


def test_encode_capacity_doubles_until_the_gain_is_small(llava_spec, toy_model) -> None:
    p = SimProfiler(llava_spec, n_requests=64, model=toy_model)
    c_e, b_sat, curve = p.encode_capacity()
    bs = [b for b, _ in curve]
    assert bs == [2**i for i in range(len(bs))]
    # every doubling before the last gained at least 5%; the last one gained less
    for (_, v0), (_, v1) in zip(curve[:-2], curve[1:-1], strict=True):
        assert v1 >= v0 * (1 + SATURATION_GAIN)
    assert curve[-1][1] < curve[-2][1] * (1 + SATURATION_GAIN)
    assert c_e == max(v for _, v in curve)
    # toy encoder: (4 ms + 2 ms/item) per batch, so capacity is bounded by 1 / (2 ms x items/request)
    items = sum(r.encoder_items for r in p.requests) / len(p.requests)
    assert c_e < 1 / (0.002 * items)


def test_stage_capacities_follow_the_profile(llava_spec, toy_model) -> None:
    p = SimProfiler(llava_spec, n_requests=64, model=toy_model)
    assert p.min_tp() == 1  # the toy backbone fits one GPU
    c1, c2 = p.prefill_capacity(1), p.prefill_capacity(2)
    assert c2.value > c1.value > 0 and c1.cost_s > 0
    # all requests queued at t = 0: FIFO batches of whole prompts up to 8192 tokens, back to back
    batches, cur = [], 0
    for r in p.requests:
        if cur and cur + r.prefill_tokens > 8192:
            batches.append(cur)
            cur = 0
        cur += r.prefill_tokens
    batches.append(cur)
    assert c1.cost_s == pytest.approx(sum(ToyProfile().prefill_s(t) for t in batches), rel=1e-9)
    assert c1.value == pytest.approx(len(p.requests) / c1.cost_s)
    d = p.decode_capacity(1)
    assert d.value > 0 and d.cost_s > 0
    alpha = p.local_prefill_efficiency()
    assert alpha is not None and 0.0 <= alpha <= 1.0
