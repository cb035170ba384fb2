"""The twin changes B and s mid-run through the same ``apply_knobs`` the live workers use."""

from __future__ import annotations

from easerve_runtime.api import load_manifest
from easerve_runtime.policies.knobs import KnobChange
from easerve_runtime.sim.runner import cached_model
from easerve_runtime.sim.twin import Control, run_pipeline
from easerve_runtime.workload.generate import generate

SPEC = "examples/llava-v1.6-34b.yaml"


def _spec(s: float):
    _, spec = load_manifest(SPEC)
    return spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": s})})


def test_s_and_b_change_mid_run_and_later_requests_follow():
    spec = _spec(0.5)
    reqs = generate(spec, 2.0, 300, 0)
    change_at = reqs[100].arrival_s
    seen: list[int] = []

    def on_tick(now, jobs):
        seen.append(len(jobs))
        if now >= change_at and not getattr(on_tick, "done", False):
            on_tick.done = True  # type: ignore[attr-defined]
            return KnobChange(encode=spec.encode.model_copy(update={"batch_bound": 1}), ratio=1.0)
        return None

    jobs, stats = run_pipeline(spec, reqs, cached_model(spec), control=Control(5.0, on_tick))
    assert all(j.rec.finish_s is not None for j in jobs)  # nothing dropped across the change
    (ch,) = stats["knob_changes"]
    assert ch["refused"] == [] and any("batchBound=1" in a for a in ch["applied"])
    t = ch["at"]
    # every request encoded after the change went remote (s = 1), and some before went local
    late = [j for j in jobs if j.req.arrival_s > t + 30]
    early = [j for j in jobs if j.req.arrival_s < t]
    assert late and all(j.route == "remote" for j in late)
    assert any(j.route == "local" for j in early)
    # the ticks saw every job (the controller reads the whole run)
    assert seen and set(seen) == {300}


def test_s_below_one_is_refused_without_local_workers():
    spec = _spec(1.0)
    reqs = generate(spec, 2.0, 120, 1)

    def on_tick(now, jobs):
        return KnobChange(ratio=0.5)

    jobs, stats = run_pipeline(spec, reqs, cached_model(spec), control=Control(30.0, on_tick))
    assert stats["knob_changes"] and all(c["refused"] and not c["applied"] for c in stats["knob_changes"])
    assert "needs a roll" in stats["knob_changes"][0]["refused"][0]
    assert all(j.route == "remote" for j in jobs)
