"""The autopilot's shell in the operator: Prometheus in, ``status.adapt`` out (``spec.tuning.adapt``).

The decisions are the pure ``tuning.adapt.Autopilot``'s (band, hold, minimum interval, guard rail
with rollback; docs/adapt.md). This module feeds it and records what it decides:

1. **Observe.** Every ``period_s`` it asks Prometheus, for the deployment's own series
   (``{namespace, epd_deployment}``, the chart's PodMonitor labels), for the arrival rate over the
   last ``window_s`` (``easerve_requests_received_total``: counted on arrival, refused requests
   included, so it leads the completions by a request's latency instead of trailing them: a
   completion rate under-read the first seconds of every step and the autopilot re-tuned to that
   ramp) and the good fraction (goodput at the objective tier / completions over the window). A sped-up sim
   deployment's figures are mapped back to the model's time (``runners.kube.time_scale``), like a
   cluster trial's.
2. **Decide.** ``Autopilot.observe``; its re-tuner is the twin (``tuning.adapt.grid_retuner`` over the
   effective spec: the allocation that runs, only the live knobs move; seconds, not trials), scored
   at the top of the band, and calibrated first with the stage costs the deployment measured
   (``stage_costs``: encode micro-batch time and size, mean TPOT; ``tuning.adapt.stage_scales``).
3. **Record and apply.** ``status.adapt`` gets the knobs in force, the latest observation and each
   decision (time, observed rate, old and new knobs, the twin's predicted goodput, why). The
   reconciler lays ``status.adapt.knobs`` over ``encode.batchBound`` / ``offload.ratio`` when the
   manifest leaves them unset (``reconcile.effective``), the ConfigMap changes, and the encode
   workers take the new values live: no pod rolls (their config hash leaves the live knobs out).

Explicit spec values are pinned and never moved, nor is s when the pod layout cannot take another
value live (s = 1: no local prefill worker; s = 0: no remote pool). The autopilot's state survives
an operator restart through ``status.adapt`` (knobs, reference rate, applied allocation).

**Allocations.** Each re-tune also asks the twin whether another allocation of the budget (the HAS
space) would do better at the observed rate, and a decision names it (``recommendedAllocation``)
when it beats the running one by more than ``RECOMMEND_MARGIN``. With
``allowAllocationChanges: true`` and ``allocation`` unset in the manifest, the autopilot *applies*
it: B and s are re-tuned on the new layout (explicit values kept), ``status.adapt.allocation``
names it, the reconciler lays it over (``reconcile.effective.lay_allocation``) and the pods roll
(surge first, as any rolling update). The guard window starts once ``status.effective`` shows the
new allocation and the deployment is Ready again, and a rollback rolls back.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from easerve_runtime.api import Allocation, EPDDeploymentSpec
from easerve_runtime.api.status import (
    AdaptCalibration,
    AdaptDecisionStatus,
    AdaptKnobs,
    AdaptRetuneStatus,
    AdaptStatus,
)
from easerve_runtime.sim.latency import StageScales

from easerve_operator.reconcile.effective import lay_allocation
from easerve_operator.tuning.adapt import (
    AdaptParams,
    Autopilot,
    Decision,
    Knobs,
    LiveCosts,
    Proposal,
    Retune,
    Retuner,
    grid_retuner,
    stage_scales,
    twin_evaluator,
    with_knobs,
)

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 10.0
KEEP_DECISIONS = 20
KEEP_RETUNES = 10
RECOMMEND_MARGIN = 0.05
APPLY_MARGIN = 0.10
"""An allocation is *applied* only when the twin, each layout with its own re-tuned knobs, gives it
this much more goodput: a roll costs capacity while it runs, and near-ties flip with the rate."""
CALIBRATION_WINDOWS = 3
BATCH_GRID = (1, 2, 4, 8, 16)
RATIO_GRID = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class RateSource(Protocol):
    def observe(self, spec: EPDDeploymentSpec) -> tuple[float, float | None] | None:
        """(arrival rate, good fraction) over the last window, real time; None: nothing to read yet."""
        ...


class CostSource(Protocol):
    def stage_costs(self, spec: EPDDeploymentSpec) -> LiveCosts | None:
        """The stage costs measured over the calibration window, real time; None: nothing to read.
        Optional on a ``RateSource``: the loop reads it (``getattr``) when a re-tune is due."""
        ...


class PrometheusRates:
    """``RateSource`` on Prometheus: rate() over the window of the deployment's own series."""

    def __init__(self, url: str, namespace: str, name: str, window_s: float = DEFAULT_WINDOW_S) -> None:
        from easerve_operator.tuning.prometheus import PrometheusScorer

        self.scorer = PrometheusScorer(url, {"namespace": namespace, "epd_deployment": name}, retries=2)
        self.window_s = window_s

    def observe(self, spec: EPDDeploymentSpec) -> tuple[float, float | None] | None:
        sel = self.scorer.selector
        w = f"{max(1, round(self.window_s))}s"
        arr = self.scorer.query(f"sum(rate(easerve_requests_received_total{{{sel}}}[{w}]))")
        if not arr:
            return None
        rate = float(arr[0]["value"][1])
        if not math.isfinite(rate):
            return None
        tier = spec.slo.objective
        done = self.scorer.query(f"sum(rate(easerve_requests_total{{{sel}}}[{w}]))")
        good = self.scorer.query(f'sum(rate(easerve_goodput_requests_total{{{sel},tier="{tier}"}}[{w}]))')
        d = float(done[0]["value"][1]) if done else 0.0
        g = float(good[0]["value"][1]) if good else 0.0
        return rate, (min(1.0, g / d) if d > 0 else None)

    def _scalar(self, expr: str) -> float | None:
        out = self.scorer.query(expr)
        if not out:
            return None
        v = float(out[0]["value"][1])
        return v if math.isfinite(v) else None

    def stage_costs(self, spec: EPDDeploymentSpec) -> LiveCosts | None:
        """Mean encode micro-batch time, items and SM share, and mean TPOT, over ``CALIBRATION_WINDOWS``
        rate windows (a longer window than the rate's: a cost is an average, it need not react fast)."""
        sel = self.scorer.selector
        w = f"{max(1, round(self.window_s * CALIBRATION_WINDOWS))}s"

        def ratio(num: str, den: str) -> float | None:
            return self._scalar(f"sum(rate({num}{{{sel}}}[{w}])) / sum(rate({den}{{{sel}}}[{w}]))")

        costs = LiveCosts(
            encode_batch_s=ratio("easerve_encode_batch_seconds_sum", "easerve_encode_batch_seconds_count"),
            encode_profile_s=ratio("easerve_encode_profile_seconds_total", "easerve_encode_batch_seconds_count"),
            encode_items_per_batch=ratio("easerve_encode_items_total", "easerve_encode_batch_seconds_count"),
            encode_share=self._scalar(f"avg(avg_over_time(easerve_partition_encode_sm_share{{{sel}}}[{w}]))"),
            tpot_s=ratio("easerve_tpot_seconds_sum", "easerve_tpot_seconds_count"),
        )
        return None if costs == LiveCosts() else costs


def pinned_knobs(raw: Mapping[str, Any], spec: EPDDeploymentSpec) -> frozenset[str]:
    """Knobs the autopilot must not move: written in the manifest, or (s) fixed by the pod layout."""
    from easerve_operator.reconcile.effective import unset_fields

    unset = unset_fields(raw)
    out = set()
    if "encode.batchBound" not in unset:
        out.add("batch_bound")
    s = spec.offload.ratio
    if "offload.ratio" not in unset or not 0.0 < s < 1.0:
        out.add("offload_ratio")
    return frozenset(out)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class AdaptLoop:
    """One deployment's autopilot, stepped by the tuning daemon while no search runs."""

    rates: RateSource
    clock: Callable[[], float] = time.time
    requests: int = 200
    pilot: Autopilot | None = None
    key: tuple[Any, ...] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    retunes: list[dict[str, Any]] = field(default_factory=list)
    """``status.adapt.retunes``: each re-tune, applied or kept (``KEEP_RETUNES`` newest)."""
    calibration: AdaptCalibration | None = None
    """The twin's live calibration (``tuning.adapt.stage_scales``), recomputed at each re-tune."""
    raw: Mapping[str, Any] = field(default_factory=dict)
    """The manifest's spec as stored (what it writes explicitly)."""
    base: EPDDeploymentSpec | None = None
    """The effective spec without the autopilot (tuned values in)."""
    allocations: dict[str, Any] = field(default_factory=dict)
    """Applied allocations by label (the pure autopilot keeps labels)."""
    rolling_to: str | None = None
    """The allocation a change rolls to, until the deployment shows it Ready."""

    @property
    def scales(self) -> StageScales:
        """The calibration as the twin's stage-cost multipliers (1.0 until a re-tune measured one)."""
        c = self.calibration
        return StageScales(c.encode, c.prefill, c.decode) if c is not None else StageScales()

    def _build(self, spec: EPDDeploymentSpec, pinned: frozenset[str], status: Mapping[str, Any] | None) -> Autopilot:
        prev = status or {}
        knobs = prev.get("knobs") or {}
        cur = Knobs(int(knobs.get("batchBound", spec.encode.batch_bound)),
                    float(knobs.get("offloadRatio", spec.offload.ratio)))
        applied = self._applied_allocation(prev, spec, cur)
        if applied is not None:  # the layout rolled to runs its own s; pin what its layout fixes
            pinned = pinned_knobs(self.raw, with_knobs(lay_allocation(self.raw, spec, applied, cur.offload_ratio)
                                                       or spec, cur))
        if "batch_bound" in pinned:
            cur = Knobs(spec.encode.batch_bound, cur.offload_ratio)
        if "offload_ratio" in pinned and applied is None:
            cur = Knobs(cur.batch_bound, spec.offload.ratio)
        ref = float(prev.get("referenceRate") or spec.tuning.target_rate or 1.0)
        window_s = float(getattr(self.rates, "window_s", DEFAULT_WINDOW_S))
        params = dataclasses.replace(AdaptParams.from_spec(spec.tuning.adapt),
                                     settle_s=window_s * CALIBRATION_WINDOWS, sample_window_s=window_s)
        holder: list[Autopilot] = []
        grids: dict[str, Retuner] = {}

        def grid_for(running: EPDDeploymentSpec, current: Callable[[], Knobs]) -> Retuner:
            evaluate = twin_evaluator(running, running.slo.objective, requests=self.requests, scales=lambda: self.scales)
            return grid_retuner(evaluate, current, BATCH_GRID, RATIO_GRID, headroom=params.band)

        def retune(rate: float, pin: frozenset[str]) -> Proposal:
            pilot = holder[0]
            running = self.running(pilot)
            self._calibrate(running, pilot.knobs, rate)
            label = running.allocation.label()
            if label not in grids:
                grids[label] = grid_for(running, lambda: holder[0].knobs)
            p = grids[label](rate, pin)
            better = self._better_allocation(running, p, rate * (1 + params.band))
            if better is None:
                return p
            alloc, laid, g = better
            if self._may_reallocate():
                # re-tune B and s on the new layout (explicit knobs and a layout-fixed s kept)
                new_pin = pinned_knobs(self.raw, laid)
                k0 = Knobs(laid.encode.batch_bound, laid.offload.ratio)
                q = grid_for(laid, lambda: k0)(rate, new_pin)
                if q.predicted_goodput < p.predicted_goodput * (1 + APPLY_MARGIN):
                    return dataclasses.replace(p, allocation=alloc.label())  # recommended only
                self.allocations[alloc.label()] = alloc
                return Proposal(q.knobs, q.predicted_goodput, allocation=alloc.label(), reallocate=alloc.label())
            return dataclasses.replace(p, allocation=alloc.label())

        pilot = Autopilot(params, cur, ref, retune, pinned=pinned)
        holder.append(pilot)
        if applied is not None:
            pilot.allocation = applied.label()
            self.allocations[applied.label()] = applied
        self.decisions = list(prev.get("decisions") or [])
        self.retunes = list(prev.get("retunes") or [])
        cal = prev.get("calibration")
        try:
            self.calibration = AdaptCalibration.model_validate(cal) if cal else None
            _ = self.scales  # a stored multiplier the twin cannot take (<= 0): start uncalibrated
        except ValueError:
            self.calibration = None
        return pilot

    def _applied_allocation(self, prev: Mapping[str, Any], spec: EPDDeploymentSpec, knobs: Knobs) -> Allocation | None:
        """The allocation an earlier change applied (``status.adapt.allocation``), if it still may
        run: the manifest still leaves the allocation to the autopilot and the layout takes ``knobs``."""
        raw = prev.get("allocation")
        if not raw or not self._may_reallocate():
            return None
        try:
            a = Allocation.model_validate(raw)
        except ValueError:
            return None
        if a == spec.allocation or lay_allocation(self.raw, spec, a, knobs.offload_ratio) is None:
            return None
        return a

    def _may_reallocate(self) -> bool:
        return self.base is not None and lay_allocation(self.raw, self.base, self.base.allocation, self.base.offload.ratio) is not None

    def running(self, pilot: Autopilot) -> EPDDeploymentSpec:
        """The spec that runs: the base, on the allocation the autopilot applied (if any), with its knobs."""
        assert self.base is not None
        spec = self.base
        if pilot.allocation is not None:
            laid = lay_allocation(self.raw, spec, self.allocations[pilot.allocation], pilot.knobs.offload_ratio)
            if laid is not None:
                spec = laid
        return with_knobs(spec, pilot.knobs)

    def _calibrate(self, spec: EPDDeploymentSpec, knobs: Knobs, rate: float) -> None:
        """Before a re-tune: scale the twin's stage costs to what the deployment measured, at the
        knobs in force (the encode cost against the profile; the mean TPOT against the uncalibrated
        twin's at this rate). The costs are read here, once a re-tune is due, not at every
        observation. Nothing measured (or no cost source): the calibration stays as it was."""
        from easerve_runtime.sim.runner import cached_model, run_trial

        from easerve_operator.tuning.runners.kube import time_scale

        source = getattr(self.rates, "stage_costs", None)
        if source is None:
            return
        try:
            costs = source(spec)
        except Exception as exc:  # noqa: BLE001 - a missing cost keeps the calibration, not the re-tune
            log.info("autopilot: no stage costs, calibration kept: %s", exc)
            return
        if costs is None:
            return
        model = cached_model(spec)
        tpot = None
        if costs.tpot_s is not None:
            m = run_trial(with_knobs(spec, knobs), rate, self.requests, 0)
            tpot = float(m["tpot_mean"]) if m.get("tpot_mean") else None
        scales = stage_scales(costs, lambda items, share: model.encode_s(items, share), tpot,
                              time_scale(spec), prev=self.scales)
        measured = {k: v for k, v in {"encodeBatchSeconds": costs.encode_batch_s,
                                      "encodeProfileSeconds": costs.encode_profile_s,
                                      "encodeItemsPerBatch": costs.encode_items_per_batch,
                                      "encodeShare": costs.encode_share,
                                      "tpotSeconds": costs.tpot_s}.items() if v is not None}
        if tpot is not None:
            measured["predictedTpotSeconds"] = tpot
        self.calibration = AdaptCalibration(encode=scales.encode, prefill=scales.prefill,
                                            decode=scales.decode, at=_iso(self.clock()), measured=measured)
        log.info("autopilot: calibration encode x%.2f decode x%.2f (%s)", scales.encode, scales.decode, measured)

    def _better_allocation(self, spec: EPDDeploymentSpec, p: Proposal, rate: float
                           ) -> tuple[Allocation, EPDDeploymentSpec, float] | None:
        """An allocation of the budget that the twin gives more goodput at ``rate`` with ``p``'s knobs
        (where the layout cannot take p's s, s = 1), and the spec running it: (allocation, spec,
        goodput). Where allocations may be applied, only those the manifest allows
        (``lay_allocation``: an explicit s or partition mode is kept)."""
        from easerve_runtime.sim.runner import run_trial

        from easerve_operator.tuning.runners.sim import SimStageProfiler
        from easerve_operator.tuning.space import Candidate, apply_candidate, space_for

        try:
            prof = SimStageProfiler(spec)
            space = space_for(spec, prof.min_tp(), local_tp=prof.local_prefill_tp())
        except ValueError:
            return None
        tier = spec.slo.objective
        strict = self._may_reallocate()
        best: tuple[Allocation, EPDDeploymentSpec, float] | None = None
        best_g = p.predicted_goodput * (1 + RECOMMEND_MARGIN)
        for a in space.allocations:
            if a.allocation() == spec.allocation:
                continue
            s = p.knobs.offload_ratio if p.knobs.offload_ratio in space.s_values(a) else 1.0
            try:
                cand = apply_candidate(spec, Candidate(a, p.knobs.batch_bound, s))
            except ValueError:
                continue
            if strict:
                laid = lay_allocation(self.raw, spec, a.allocation(), s)
                if laid is None:
                    continue
                cand = with_knobs(laid, Knobs(p.knobs.batch_bound, s))
            g = float(run_trial(cand, rate, self.requests, 0)["goodput"][tier])
            if g > best_g:
                best, best_g = (a.allocation(), cand, g), g
        return best

    def step(self, raw: Mapping[str, Any], spec: EPDDeploymentSpec, status: Mapping[str, Any] | None,
             deployment: Mapping[str, Any] | None = None) -> AdaptStatus | None:
        """One observation; the ``status.adapt`` to write (None: nothing new to say).

        ``spec`` is the effective spec (tuned values in, the autopilot's own knobs and allocation
        not), ``status`` the last ``status.adapt``, ``deployment`` the whole status (to see a roll
        to an applied allocation end; None: nothing rolls)."""
        from easerve_operator.tuning.runners.kube import time_scale

        pinned = pinned_knobs(raw, spec)
        key = (spec.allocation.label(), spec.tuning.adapt.model_dump_json(), pinned, spec.tuning.target_rate)
        self.raw, self.base = raw, spec
        if self.pilot is None or key != self.key:
            self.allocations, self.rolling_to = {}, None
            self.pilot, self.key = self._build(spec, pinned, status), key
        pilot = self.pilot
        try:
            seen = self.rates.observe(spec)
        except Exception as exc:  # noqa: BLE001 - Prometheus hiccups: say so, keep the knobs
            return self._status(pilot, pilot.pinned, None, None, f"no observation: {type(exc).__name__}: {exc}"[:300])
        if seen is None:
            return self._status(pilot, pilot.pinned, None, None, "no traffic observed yet")
        k = time_scale(spec)
        rate, good = seen[0] / k, seen[1]
        now = self.clock()
        d = pilot.observe(now, rate, good, settled=self._settled(deployment))
        if d is not None and d.reallocates:
            running = self.running(pilot)
            pilot.pinned = pinned_knobs(raw, running)  # s may be fixed, or freed, by the new layout
            self.rolling_to = running.allocation.label()
            log.info("autopilot: allocation %s -> %s (a roll)", d.old_allocation or spec.allocation.label(),
                     d.new_allocation or spec.allocation.label())
        if pilot.retunes:
            self.retunes.extend(retune_status(r) for r in pilot.retunes)
            self.retunes = self.retunes[-KEEP_RETUNES:]
            pilot.retunes.clear()
        if d is not None:
            self.decisions.append(decision_status(d, now, spec.allocation.label()))
            self.decisions = self.decisions[-KEEP_DECISIONS:]
            log.info("autopilot: %s B %d -> %d, s %g -> %g (%s)", d.kind, d.old.batch_bound, d.new.batch_bound,
                     d.old.offload_ratio, d.new.offload_ratio, d.reason)
        return self._status(pilot, pilot.pinned, rate, good, None, now)

    def _settled(self, deployment: Mapping[str, Any] | None) -> bool:
        """False while the deployment rolls to the allocation last applied (status.effective shows
        another one, or it is not Ready yet)."""
        if self.rolling_to is None or deployment is None:
            return True
        eff = deployment.get("effective") or {}
        if eff.get("allocationLabel") == self.rolling_to and deployment.get("phase") == "Ready":
            self.rolling_to = None
            return True
        return False

    def _status(self, pilot: Autopilot, pinned: frozenset[str], rate: float | None, good: float | None,
                message: str | None, now: float | None = None) -> AdaptStatus:
        alloc = self.allocations.get(pilot.allocation) if pilot.allocation is not None else None
        if self.rolling_to is not None and message is None:
            message = f"rolling to allocation {self.rolling_to}"
        return AdaptStatus(
            allocation=alloc,
            allocation_label=alloc.label() if alloc is not None else None,
            knobs=AdaptKnobs(batch_bound=pilot.knobs.batch_bound, offload_ratio=pilot.knobs.offload_ratio),
            reference_rate=pilot.reference_rate,
            observed_rate=rate,
            good_fraction=good,
            observed_at=_iso(now) if now is not None else None,
            pinned=sorted(pinned),
            decisions=[AdaptDecisionStatus.model_validate(x) for x in self.decisions],
            retunes=[AdaptRetuneStatus.model_validate(x) for x in self.retunes],
            calibration=self.calibration,
            message=message,
        )


def retune_status(r: Retune) -> dict[str, Any]:
    """``r`` as ``status.adapt.retunes[]``."""
    return {
        "at": _iso(r.at),
        "observedRate": r.observed_rate,
        "referenceRate": r.reference_rate,
        "direction": "above" if r.side > 0 else "below",
        "answer": {"batchBound": r.answer.batch_bound, "offloadRatio": r.answer.offload_ratio},
        "predictedGoodput": r.predicted_goodput,
        "applied": r.applied,
    }


def decision_status(d: Decision, now: float, own_allocation: str | None = None) -> dict[str, Any]:
    """``d`` as ``status.adapt.decisions[]``; ``own_allocation`` names the deployment's own
    allocation (the pure autopilot's None) in an allocation change."""
    return {
        "at": _iso(now),
        "kind": d.kind,
        "observedRate": d.observed_rate,
        "referenceRate": d.reference_rate,
        "old": {"batchBound": d.old.batch_bound, "offloadRatio": d.old.offload_ratio},
        "new": {"batchBound": d.new.batch_bound, "offloadRatio": d.new.offload_ratio},
        "predictedGoodput": d.predicted_goodput,
        "reason": d.reason,
        "recommendedAllocation": d.recommended_allocation,
        "oldAllocation": (d.old_allocation or own_allocation) if d.reallocates else None,
        "newAllocation": (d.new_allocation or own_allocation) if d.reallocates else None,
    }
