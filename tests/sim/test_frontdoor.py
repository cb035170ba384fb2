"""The twin's front door: the live frontends' admission control, replayed in virtual time.

The cluster trials refuse requests at the door when the offered rate exceeds the admission bound's
capacity estimate (issue 13, must-hold 3); the twin predicts that only when it admits as they do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from easerve_runtime.policies.admission import queue_bound
from easerve_runtime.profiles.capacity import saturation_rps
from easerve_runtime.sim.frontdoor import FrontDoor
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.stages import Job
from easerve_runtime.sim.systems import simulate_system
from easerve_runtime.workload.generate import generate

REPO = Path(__file__).resolve().parents[2]


def _limits(spec, **kw):
    return spec.model_copy(update={"limits": spec.limits.model_copy(update=kw)})


def test_the_door_bounds_each_frontend_and_deals_round_robin(llava_spec):
    door = FrontDoor(llava_spec, frontends=2)
    cap = saturation_rps(llava_spec) / 2
    bound = queue_bound(cap, llava_spec.limits.queue_seconds)
    assert door.bound == bound and door.capacity_rps == cap
    jobs = [Job(r) for r in generate(llava_spec, 1.0, 2 * bound + 2, seed=3)]
    admitted = [door.admit(j, 0.0) for j in jobs]
    # round-robin: each frontend takes `bound`, then both refuse (the last two, one each)
    assert admitted == [True] * (2 * bound) + [False, False]
    assert door.refused == 2
    assert all(j.rec.error and j.rec.error.startswith("429") for j in jobs[-2:])
    # a first token frees its frontend's place: the next request dealt there is admitted
    first = jobs[0]
    first.rec.first_token_s = first.rec.arrival_s + 0.5
    door.first_token(first)
    extra = [Job(r) for r in generate(llava_spec, 1.0, 2, seed=4)]
    assert [door.admit(j, 1.0) for j in extra] == [True, False]


def test_the_twin_refuses_what_the_bound_cannot_take_and_nothing_else(llava_spec):
    model = cached_model(llava_spec)
    cap = saturation_rps(llava_spec)
    over = generate(llava_spec, 1.5 * cap, 200, seed=7)
    open_door = simulate_system(llava_spec, over, "easerve", model)
    door = simulate_system(llava_spec, over, "easerve", model, frontends=2)
    refused = door.stats["admission"]["refused"]
    assert open_door.summary["failed"] == 0 and "admission" not in open_door.stats
    assert refused > 0 and door.summary["failed"] == refused
    assert sum(1 for r in door.records if r.error and r.error.startswith("429")) == refused
    # the requests refused at the door were the ones that would have waited longest
    assert door.summary["ttft_p99"] < open_door.summary["ttft_p99"]
    # a fixed bound no burst reaches (spec.limits.maxQueuedRequests) admits all, and then the bound
    # plays no part: any wider one runs exactly the same (the frontends still route by their own counts)
    wide = simulate_system(_limits(llava_spec, max_queued_requests=10_000), over, "easerve", model, frontends=2)
    wider = simulate_system(_limits(llava_spec, max_queued_requests=10**6), over, "easerve", model, frontends=2)
    assert wide.stats["admission"]["refused"] == 0 and wide.summary["completed"] == len(over)
    assert [(r.first_token_s, r.finish_s) for r in wide.records] == [(r.first_token_s, r.finish_s) for r in wider.records]


def test_the_door_can_size_its_queue_from_another_profiles_capacity(llava_spec):
    """A twin timed with one profile predicts pods that read another (an H100 run served with the
    H200 profile): its door sizes from the rate given, and a smaller bound refuses more."""
    model = cached_model(llava_spec)
    cap = saturation_rps(llava_spec)
    door = FrontDoor(llava_spec, frontends=2, capacity_rps=0.5 * cap)
    assert door.capacity_rps == 0.25 * cap
    assert door.bound == queue_bound(0.25 * cap, llava_spec.limits.queue_seconds) < FrontDoor(llava_spec, 2).bound
    over = generate(llava_spec, 1.5 * cap, 200, seed=7)
    own = simulate_system(llava_spec, over, "easerve", model, frontends=2)
    given = simulate_system(llava_spec, over, "easerve", model, frontends=2, door_capacity_rps=0.5 * cap)
    assert given.stats["admission"]["capacity_rps"] == 0.25 * cap
    assert given.stats["admission"]["refused"] > own.stats["admission"]["refused"]


def test_below_capacity_the_door_changes_nothing(llava_spec):
    model = cached_model(llava_spec)
    light = generate(llava_spec, 0.3 * saturation_rps(llava_spec), 150, seed=9)
    a = simulate_system(_limits(llava_spec, max_queued_requests=10**6), light, "easerve", model, frontends=2)
    b = simulate_system(llava_spec, light, "easerve", model, frontends=2)
    assert b.stats["admission"]["refused"] == 0
    assert a.summary["completed"] == b.summary["completed"] == 150
    assert [r.first_token_s for r in a.records] == [r.first_token_s for r in b.records]


def test_each_frontend_routes_by_its_own_requests_as_the_live_ones_do(llava_spec):
    """The live frontend picks the encode worker with the fewest of *its own* requests in flight
    (``workers.pool.Pool``); k frontends see nothing of each other's. With the door modelled the twin
    routes so too: each frontend's picks are balanced over the encode workers, the union need not be."""
    from easerve_runtime.api import Allocation, StageAllocation

    spec = llava_spec.model_copy(update={"allocation": Allocation(
        encode=StageAllocation(replicas=4), prefill=StageAllocation(replicas=1, tensor_parallel=2),
        decode=StageAllocation(replicas=1, tensor_parallel=2))})
    spec = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 1.0})})
    model = cached_model(spec)
    wide = _limits(spec, max_queued_requests=10**6)  # no refusals: only the routing differs
    busy = generate(spec, 0.9 * saturation_rps(spec), 200, seed=5)
    one = simulate_system(wide, busy, "easerve", model, frontends=1)
    four = simulate_system(wide, busy, "easerve", model, frontends=4)
    assert one.summary["completed"] == four.summary["completed"] == 200
    # one frontend sees every request it sent; four, each blind to the others' requests, send some
    # to an encoder another keeps busy: the same requests meet other queues
    assert [r.first_token_s for r in one.records] != [r.first_token_s for r in four.records]


def test_the_frontends_rotation_starts_can_be_given_and_in_step_they_cost_the_all_local_trial():
    """``frontend_starts``: the twin takes the live frontends' drawn starts (``twin_p99_spread.py
    --noise starts``). Given as the even spread, it is the default run; given in step (three
    frontends at one start, what hashing fixed names did), the all-local trial's requests queue
    in bursts at one encoder per pick and its mean TTFT rises."""
    from easerve_operator.tuning.space import Alloc, Candidate, apply_candidate
    from easerve_runtime.api import load_manifest
    from easerve_runtime.policies.router import spread_rotation_starts
    from easerve_runtime.sim.runner import cached_model
    from easerve_runtime.sim.systems import simulate_system
    from easerve_runtime.topology import frontends_for
    from easerve_runtime.workload.generate import generate

    base = load_manifest(str(REPO / "examples" / "llava-v1.6-34b.yaml"))[1]
    spec = apply_candidate(base, Candidate(Alloc(6, 0, 2, 1, 2), 1, 0.0))
    k = frontends_for(spec)
    assert k == 3
    reqs = generate(spec, 3.0, 300, 1)

    def run(starts):
        return simulate_system(spec, reqs, "easerve", cached_model(spec), frontends=k, frontend_starts=starts)

    default, spread, in_step = run(None), run(spread_rotation_starts(6, 3)), run([4, 4, 4])
    assert [r.ttft_s for r in default.records] == [r.ttft_s for r in spread.records]
    assert in_step.summary["ttft_mean"] > 1.05 * spread.summary["ttft_mean"]
    with pytest.raises(ValueError, match="one start per frontend"):
        run([0, 2])
