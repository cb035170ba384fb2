"""The operator's autopilot shell: observations in, ``status.adapt`` out, the knobs laid over the
unset fields by ``reconcile.effective`` (and reaching the ConfigMap without rolling the encode pods).

The decisions are the pure Autopilot's (tests/tuning/test_adapt.py); here its shell is driven with a
fake rate source on an injected clock and the real twin as the re-tuner, on the video example whose
best B moves with the load (B = 1 at 1 req/s, 2 at 2 req/s on the twin).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from easerve_operator.reconcile.adapt_loop import AdaptLoop, pinned_knobs
from easerve_operator.reconcile.effective import resolve
from easerve_operator.render import render_children
from easerve_runtime.api import parse_spec

REPO = Path(__file__).resolve().parents[2]


def raw_spec(drop_b: bool = True, drop_s: bool = True) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "qwen2.5-vl-32b.yaml").read_text())
    sp = doc["spec"]
    if drop_b:
        sp["encode"].pop("batchBound")
    if drop_s:
        sp.pop("offload")
    sp["tuning"] = {"enabled": True, "targetRate": 1.0, "trials": "twin",
                    "adapt": {"enabled": True, "band": 0.3, "holdSeconds": 6, "minIntervalSeconds": 12,
                              "guardWindowSeconds": 8}}
    return sp


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


class Rates:
    """The load a Prometheus would show: a step trace on the injected clock (real time = model time)."""

    def __init__(self, clock: Clock, steps: list[tuple[float, float]]) -> None:
        self.clock, self.steps, self.t0 = clock, steps, clock.t

    def observe(self, spec: Any) -> tuple[float, float | None]:
        t = self.clock.t - self.t0
        rate = next(r for until, r in self.steps if t < until)
        return rate, 0.95


def tuned(raw: dict[str, Any]) -> dict[str, Any]:
    """A finished search's status.tuning for ``raw`` (B 1, s 0.7: the twin's best at 1 req/s)."""
    from easerve_operator.reconcile.effective import fingerprint

    spec = parse_spec(raw)
    return {"state": "Succeeded", "fingerprint": fingerprint(spec), "partition": "dynamic",
            "best": {"allocation": spec.allocation.label(), "specAllocation": spec.allocation.wire(),
                     "batchBound": 1, "offloadRatio": 0.7}}


def run(raw: dict[str, Any], steps: list[tuple[float, float]], seconds: float) -> tuple[AdaptLoop, list[Any]]:
    clock = Clock()
    loop = AdaptLoop(Rates(clock, steps), clock=clock, requests=120)
    eff = resolve(raw, parse_spec(raw), tuned(raw), None)
    assert eff.spec is not None
    status: dict[str, Any] | None = None
    out = []
    while clock.t - 1_000_000.0 < seconds:
        st = loop.step(raw, eff.spec, status)
        assert st is not None
        status = st.model_dump(mode="json", by_alias=True)
        out.append(status)
        clock.t += 2.0
    return loop, out


def test_b_follows_a_step_in_the_load_and_each_change_is_recorded() -> None:
    raw = raw_spec()
    _, out = run(raw, [(30, 1.0), (80, 2.0), (1e9, 1.0)], 130)
    last = out[-1]
    ds = last["decisions"]
    assert [d["observedRate"] for d in ds] == [2.0, 1.0], ds  # one change at each step, none between
    up, down = ds
    assert up["old"] == {"batchBound": 1, "offloadRatio": 0.7} and up["new"] != up["old"]
    assert up["kind"] == "retune" and up["predictedGoodput"] > 0 and "above the band" in up["reason"]
    assert down["old"] == up["new"] and "below the band" in down["reason"] and up["at"].endswith("Z")
    assert last["knobs"] == down["new"] and last["referenceRate"] == 1.0
    # status.adapt.retunes says the same of these two (a re-tune that kept the knobs would show only there)
    rs = last["retunes"]
    assert [(r["direction"], r["observedRate"], r["applied"]) for r in rs] == [("above", 2.0, True), ("below", 1.0, True)]
    assert [r["answer"] for r in rs] == [up["new"], down["new"]] and [r["at"] for r in rs] == [up["at"], down["at"]]
    # and an operator restart keeps them (a fresh loop reads them back from status)
    clock = Clock()
    again = AdaptLoop(Rates(clock, [(1e9, 1.0)]), clock=clock, requests=120)
    eff = resolve(raw, parse_spec(raw), tuned(raw), None)
    assert eff.spec is not None
    st = again.step(raw, eff.spec, last)
    assert st is not None and st.model_dump(mode="json", by_alias=True)["retunes"] == rs
    # each re-tune asks the twin for a better allocation of the budget (recommended, not applied)
    from easerve_operator.tuning.runners.sim import SimStageProfiler
    from easerve_operator.tuning.space import space_for

    s = parse_spec(raw)
    labels = {a.label for a in space_for(s, SimStageProfiler(s).min_tp()).allocations}
    assert all(d["recommendedAllocation"] in labels | {None} for d in ds)
    assert all(d["recommendedAllocation"] != s.allocation.label() for d in ds)
    assert last["pinned"] == [] and last["observedRate"] == 1.0 and last["goodFraction"] == 0.95


def test_explicit_values_are_pinned_and_never_moved() -> None:
    raw = raw_spec(drop_b=False)  # B written in the manifest
    spec = resolve(raw, parse_spec(raw), tuned(raw), None).spec
    assert spec is not None
    assert pinned_knobs(raw, spec) == frozenset({"batch_bound"})
    _, out = run(raw, [(30, 1.0), (1e9, 2.0)], 80)
    assert all(d["new"]["batchBound"] == spec.encode.batch_bound for d in out[-1]["decisions"])
    assert out[-1]["knobs"]["batchBound"] == spec.encode.batch_bound


def test_the_adapted_knobs_run_live_without_rolling_the_encode_pods() -> None:
    raw = raw_spec()
    st = {"tuning": tuned(raw)}
    base = resolve(raw, parse_spec(raw), st["tuning"], None)
    moved = resolve(raw, parse_spec(raw), st["tuning"], None,
                    {"knobs": {"batchBound": 2, "offloadRatio": 0.5}})
    assert base.spec is not None and moved.spec is not None
    assert moved.spec.encode.batch_bound == 2 and moved.spec.offload.ratio == 0.5
    assert moved.sources["encode.batchBound"] == "adapted" and moved.key != base.key
    # keyed by kind too: a Deployment and its Service share a name
    a = {(o["kind"], o["metadata"]["name"]): o for o in render_children("q", "ns", "u", base.spec)}
    b = {(o["kind"], o["metadata"]["name"]): o for o in render_children("q", "ns", "u", moved.spec)}
    assert a["ConfigMap", "q-config"]["data"] != b["ConfigMap", "q-config"]["data"], "the ConfigMap carries the new knobs"
    deployments = [n for n in a if n[0] == "Deployment"]
    assert len(deployments) == 3
    for n in deployments:  # no pod template changes: nothing rolls
        assert a[n]["spec"]["template"] == b[n]["spec"]["template"], n
    # an s the pod layout cannot take live (1: no local prefill worker) is not laid over
    one = resolve(raw, parse_spec(raw), st["tuning"], None, {"knobs": {"batchBound": 2, "offloadRatio": 1.0}})
    assert one.spec is not None and one.spec.offload.ratio == 0.7


def test_adapt_off_lays_nothing_over() -> None:
    raw = raw_spec()
    raw2 = copy.deepcopy(raw)
    raw2["tuning"]["adapt"]["enabled"] = False
    r = resolve(raw2, parse_spec(raw2), tuned(raw2), None, {"knobs": {"batchBound": 2, "offloadRatio": 0.5}})
    assert r.spec is not None and r.spec.encode.batch_bound == 1 and r.adapted is None


class CostlyRates(Rates):
    """``Rates`` plus the stage costs a Prometheus would show: the encoder ``factor`` x the profile's."""

    def __init__(self, clock: Clock, steps: list[tuple[float, float]], spec: Any, factor: float) -> None:
        super().__init__(clock, steps)
        from easerve_runtime.sim.runner import cached_model

        self.factor = factor
        self.encode_s = cached_model(spec).encode_s(2, 1.0) * factor

    def stage_costs(self, spec: Any) -> Any:
        from easerve_operator.tuning.adapt import LiveCosts

        return LiveCosts(encode_batch_s=self.encode_s, encode_profile_s=self.encode_s / self.factor,
                         encode_items_per_batch=2.0, encode_share=1.0)


def test_each_retune_calibrates_the_twin_with_the_measured_costs() -> None:
    """The encoder measured 2.5x slower than the profile: the re-tune's twin runs with that cost
    (status.adapt.calibration says so), and predicts less goodput for the step than the twin fed
    costs equal to the profile's (calibration 1.0)."""
    raw = raw_spec()
    spec = parse_spec(raw)
    steps = [(30, 1.0), (1e9, 2.0)]
    results = {}
    for factor in (1.0, 2.5):
        clock = Clock()
        loop = AdaptLoop(CostlyRates(clock, steps, spec, factor), clock=clock, requests=120)
        eff = resolve(raw, spec, tuned(raw), None)
        assert eff.spec is not None
        status: dict[str, Any] | None = None
        while clock.t - 1_000_000.0 < 60:
            st = loop.step(raw, eff.spec, status)
            assert st is not None
            status = st.model_dump(mode="json", by_alias=True)
            clock.t += 2.0
        assert status is not None
        results[factor] = status
    for factor, st in results.items():
        cal = st["calibration"]
        assert cal["encode"] == factor and cal["decode"] == 1.0 and cal["prefill"] == 1.0, cal
        assert cal["measured"]["encodeItemsPerBatch"] == 2.0 and cal["at"].endswith("Z")
    g1 = results[1.0]["decisions"][0]["predictedGoodput"]
    g25 = results[2.5]["decisions"][0]["predictedGoodput"]
    assert g25 < g1, (g1, g25)
    # the calibration survives an operator restart (read back from status.adapt)
    loop = AdaptLoop(Rates(Clock(), steps), requests=120)
    eff = resolve(raw, spec, tuned(raw), None)
    assert eff.spec is not None
    loop.step(raw, eff.spec, results[2.5])
    assert loop.scales.encode == 2.5


def realloc_raw() -> dict[str, Any]:
    """The video example with its allocation left to HAS and allocation changes allowed."""
    raw = raw_spec()
    raw.pop("allocation")
    raw["smPartition"].pop("mode")
    raw["tuning"]["adapt"]["allowAllocationChanges"] = True
    return raw


HAS_PICK = {"encode": {"replicas": 2, "tensorParallel": 1}, "prefill": {"replicas": 2, "tensorParallel": 2},
            "decode": {"replicas": 1, "tensorParallel": 2}}
"""What HAS picks for ``realloc_raw`` at 1 req/s on the twin (2E-2P(tp2)-1D(tp2), B 1, s 0.7)."""


def tuned_alloc(raw: dict[str, Any]) -> dict[str, Any]:
    """A finished search's status.tuning for ``realloc_raw``: HAS's pick."""
    from easerve_operator.reconcile.effective import fingerprint

    spec = parse_spec({**raw, "allocation": HAS_PICK})
    return {"state": "Succeeded", "fingerprint": fingerprint(parse_spec(raw)), "partition": "dynamic",
            "best": {"allocation": spec.allocation.label(), "specAllocation": spec.allocation.wire(),
                     "batchBound": 1, "offloadRatio": 0.7}}


class SlowDecodeRates(Rates):
    """``Rates`` plus a decode measured 2x slower than its profile: the mean TPOT a Prometheus
    would show is twice the twin's at the knobs, allocation and rate in force."""

    def stage_costs(self, spec: Any) -> Any:
        from easerve_operator.tuning.adapt import LiveCosts
        from easerve_runtime.sim.runner import run_trial

        rate = next(r for until, r in self.steps if self.clock.t - self.t0 < until)
        return LiveCosts(tpot_s=2.0 * float(run_trial(spec, rate, 120, 0)["tpot_mean"]))


def test_an_allowed_allocation_change_is_applied_with_a_roll_and_judged_after_it() -> None:
    """allowAllocationChanges with the allocation unset, and a decode measured 2x slower than its
    profile: at the drop to 0.5 req/s the calibrated twin prefers a faster decode pool (the HAS
    pick's TPOT is now over the tier's); the autopilot applies it (status.adapt.allocation),
    the reconciler lays it over (source ``adapted``) and the rendered pods change (a roll). While
    the deployment has not shown the new allocation Ready, nothing else is decided; an operator
    restart keeps the applied allocation."""
    raw = realloc_raw()
    spec = parse_spec(raw)
    st_tuning = tuned_alloc(raw)
    eff = resolve(raw, spec, st_tuning, None)
    assert eff.spec is not None and eff.spec.allocation.label() == "2E-2P(tp2)-1D(tp2)"
    clock = Clock()
    loop = AdaptLoop(SlowDecodeRates(clock, [(30, 1.0), (1e9, 0.5)]), clock=clock, requests=120)
    deployment: dict[str, Any] = {"phase": "Ready", "effective": {"allocationLabel": eff.spec.allocation.label()}}
    status: dict[str, Any] | None = None
    while clock.t - 1_000_000.0 < 120:
        st = loop.step(raw, eff.spec, status, deployment=deployment)
        assert st is not None
        status = st.model_dump(mode="json", by_alias=True)
        clock.t += 2.0
    assert status is not None
    ds = status["decisions"]
    assert len(ds) == 1, ds  # the roll never settled: no second decision, no guard verdict
    d = ds[0]
    assert d["oldAllocation"] == "2E-2P(tp2)-1D(tp2)", d
    assert d["newAllocation"] == d["recommendedAllocation"] and d["newAllocation"] != d["oldAllocation"]
    assert status["calibration"]["decode"] == 2.0
    assert status["allocationLabel"] == d["newAllocation"] and status["allocation"]
    assert status["message"] == f"rolling to allocation {d['newAllocation']}"
    moved = resolve(raw, spec, st_tuning, None, status)
    assert moved.spec is not None and moved.spec.allocation.label() == d["newAllocation"]
    assert moved.sources["allocation"] == "adapted" and moved.key != eff.key
    assert moved.spec.offload.ratio == status["knobs"]["offloadRatio"]
    before = {(o["kind"], o["metadata"]["name"]): o for o in render_children("q", "ns", "u", eff.spec)}
    after = {(o["kind"], o["metadata"]["name"]): o for o in render_children("q", "ns", "u", moved.spec)}
    changed = [n for n, o in after.items() if n[0] == "Deployment" and (n not in before or o["spec"] != before[n]["spec"])]
    assert changed, "the new allocation changes the pods"
    # the roll ends: status.effective shows the new allocation Ready; the guard window starts
    deployment = {"phase": "Ready", "effective": {"allocationLabel": d["newAllocation"]}}
    st2 = loop.step(raw, eff.spec, status, deployment=deployment)
    assert st2 is not None and st2.message is None
    # an operator restart: a new loop reads the applied allocation back from status.adapt
    again = AdaptLoop(Rates(Clock(), [(1e9, 0.5)]), requests=120)
    st3 = again.step(raw, eff.spec, status, deployment=deployment)
    assert st3 is not None and st3.allocation_label == d["newAllocation"]


def test_an_explicit_allocation_is_only_recommended_even_when_changes_are_allowed() -> None:
    raw = raw_spec()  # the example's allocation is written in the manifest
    raw["tuning"]["adapt"]["allowAllocationChanges"] = True
    _, out = run(raw, [(30, 1.0), (1e9, 2.0)], 60)
    ds = out[-1]["decisions"]
    assert ds and all(d["newAllocation"] is None for d in ds), ds
    assert any(d["recommendedAllocation"] for d in ds) and out[-1]["allocation"] is None
    r = resolve(raw, parse_spec(raw), tuned(raw), None, {**out[-1], "allocation": tuned_alloc(raw)["best"]["specAllocation"]})
    assert r.sources["allocation"] == "spec"


def test_a_restart_keeps_the_s_of_an_applied_allocation_whose_base_layout_pins_s() -> None:
    """The tuned layout runs s = 1 (pinned: no local prefill), the applied one s = 0.5. After an
    operator restart the loop must restore the applied layout *with its own s*, not the base's."""
    raw = realloc_raw()
    spec = parse_spec(raw)
    tun = tuned_alloc(raw)
    tun["best"]["offloadRatio"] = 1.0
    base = resolve(raw, spec, tun, None).spec
    assert base is not None and base.offload.ratio == 1.0
    assert pinned_knobs(raw, base) == frozenset({"offload_ratio"})
    applied = {"encode": {"replicas": 2, "tensorParallel": 1}, "prefill": {"replicas": 1, "tensorParallel": 2},
               "decode": {"replicas": 1, "tensorParallel": 4}}
    status = {"knobs": {"batchBound": 2, "offloadRatio": 0.5}, "referenceRate": 0.5, "allocation": applied}
    loop = AdaptLoop(Rates(Clock(), [(1e9, 0.5)]), requests=120)
    st = loop.step(raw, base, status)
    assert st is not None and st.allocation_label == "2E-1P(tp2)-1D(tp4)"
    assert st.knobs.offload_ratio == 0.5 and st.knobs.batch_bound == 2 and st.pinned == []
    r = resolve(raw, spec, tun, None, st.model_dump(mode="json", by_alias=True))
    assert r.spec is not None and r.spec.allocation.label() == "2E-1P(tp2)-1D(tp4)" and r.spec.offload.ratio == 0.5
    assert r.spec.sm_partition.mode == "dynamic" and r.sources["smPartition.mode"] == "adapted"
