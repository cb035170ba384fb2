"""Time-slicing of a GPU shared by pods (``sim.timeslice``): the twin of ``easerve serve`` on a host
with fewer GPUs than the deployment asks for. With GPUs of their own (the Kubernetes case, or a host
with enough of them) the twin is unchanged to the bit; on one GPU every stage pays for the others."""

from __future__ import annotations

from easerve_runtime.sim import simulate_system
from easerve_runtime.sim.events import EventLoop
from easerve_runtime.sim.timeslice import TimeSlicing, placement
from easerve_runtime.sim.twin import topology
from easerve_runtime.workload import generate


def test_work_dispatched_beside_busy_pods_on_its_gpu_pays_one_share_per_pod() -> None:
    loop = EventLoop()
    ts = TimeSlicing(loop, {"encode/0": frozenset({0}), "prefill/0": frozenset({0}), "decode/0": frozenset({1})})
    assert ts.dilation("encode/0") == 1.0  # nothing in flight
    ts.occupy("prefill/0", 5.0)
    ts.occupy("decode/0", 5.0)
    assert ts.dilation("encode/0") == 2.0  # prefill shares GPU 0; decode is on GPU 1
    assert ts.dilation("prefill/0") == 1.0  # its own work does not slow it
    assert ts.dilation("decode/0") == 1.0
    assert ts.dilation("frontend/0") == 1.0  # no GPU
    loop.at(5.0, lambda: None)
    loop.run()
    assert ts.dilation("encode/0") == 1.0  # prefill's work ended at 5.0


def test_placement_follows_easerve_serves_host_gpus(llava_spec, toy_model) -> None:
    topo = topology(llava_spec, toy_model)  # E2 P1(tp2) D2(tp2): 8 GPUs, local prefill in the encode pods
    assert placement(topo, None) == {}
    assert placement(topo, 8) == {}  # every pod on GPUs of its own: nothing shared
    one = placement(topo, 1)
    assert one and set(one.values()) == {frozenset({0})}
    assert {k.split("/")[0] for k in one} == {"encode", "prefill", "decode"}
    four = placement(topo, 4)
    assert any(a != b and four[a] & four[b] for a in four for b in four)


def test_gpus_of_their_own_change_nothing_and_one_shared_gpu_slows_every_stage(llava_spec, toy_model) -> None:
    reqs = generate(llava_spec, 2.0, 200, seed=11)
    alone = simulate_system(llava_spec, reqs, "easerve", toy_model)
    enough = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=8)
    shared = simulate_system(llava_spec, reqs, "easerve", toy_model, host_gpus=1)
    assert [(r.first_token_s, r.finish_s) for r in enough.records] == [(r.first_token_s, r.finish_s) for r in alone.records]
    assert "time_slicing" not in alone.stats and "time_slicing" not in enough.stats
    ts = shared.stats["time_slicing"]
    assert ts["host_gpus"] == 1 and 0 < ts["charged"] <= ts["dispatches"]
    assert len(shared.records) == len(alone.records)  # nothing lost
    assert shared.summary["tpot_mean"] > alone.summary["tpot_mean"]
    assert shared.summary["ttft_mean"] > alone.summary["ttft_mean"]


def test_has_trial_runner_runs_its_trials_on_the_host_it_is_given(llava_spec) -> None:
    """``SimRunner(host_gpus=1)``: HAS's trials time-slice one GPU, as the deployment they pick will."""
    from easerve_operator.tuning.runners.sim import SimRunner
    from easerve_runtime.sim.runner import cached_model

    own, shared = SimRunner().run_trial(llava_spec, 2.0, 120, 3), SimRunner(host_gpus=1).run_trial(llava_spec, 2.0, 120, 3)
    want = simulate_system(llava_spec, generate(llava_spec, 2.0, 120, 3), "easerve", cached_model(llava_spec), host_gpus=1,
                           frontends=1)  # the runner's trials pass the door of one host's one frontend
    assert shared.tpot_mean == want.summary["tpot_mean"] and shared.ttft_mean == want.summary["ttft_mean"]
    assert shared.tpot_mean > own.tpot_mean
