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
an operator restart through ``status.adapt`` (knobs and reference rate). Allocation changes are not
applied: each re-tune also asks the twin whether another allocation of the budget (the HAS space)
would do better at the observed rate with the new knobs, and a decision names it
(``recommendedAllocation``) when it beats the running one by more than ``RECOMMEND_MARGIN``;
``allowAllocationChanges: true`` (a roll per change) is refused at admission until that is built.
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

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.api.status import AdaptCalibration, AdaptDecisionStatus, AdaptKnobs, AdaptStatus
from easerve_runtime.sim.latency import StageScales

from easerve_operator.tuning.adapt import (
    AdaptParams,
    Autopilot,
    Decision,
    Knobs,
    LiveCosts,
    Proposal,
    grid_retuner,
    stage_scales,
    twin_evaluator,
    with_knobs,
)

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 10.0
KEEP_DECISIONS = 20
RECOMMEND_MARGIN = 0.05
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
    calibration: AdaptCalibration | None = None
    """The twin's live calibration (``tuning.adapt.stage_scales``), recomputed at each re-tune."""

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
        if "batch_bound" in pinned:
            cur = Knobs(spec.encode.batch_bound, cur.offload_ratio)
        if "offload_ratio" in pinned:
            cur = Knobs(cur.batch_bound, spec.offload.ratio)
        ref = float(prev.get("referenceRate") or spec.tuning.target_rate or 1.0)
        params = AdaptParams.from_spec(spec.tuning.adapt)
        evaluate = twin_evaluator(spec, spec.slo.objective, requests=self.requests, scales=lambda: self.scales)
        holder: list[Autopilot] = []
        grid = grid_retuner(evaluate, lambda: holder[0].knobs, BATCH_GRID, RATIO_GRID, headroom=params.band)

        def retune(rate: float, pin: frozenset[str]) -> Proposal:
            self._calibrate(spec, holder[0].knobs, rate)
            p = grid(rate, pin)
            return dataclasses.replace(p, allocation=self._better_allocation(spec, p, rate * (1 + params.band)))

        pilot = Autopilot(params, cur, ref, retune, pinned=pinned)
        holder.append(pilot)
        self.decisions = list(prev.get("decisions") or [])
        cal = prev.get("calibration")
        try:
            self.calibration = AdaptCalibration.model_validate(cal) if cal else None
            _ = self.scales  # a stored multiplier the twin cannot take (<= 0): start uncalibrated
        except ValueError:
            self.calibration = None
        return pilot

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

    def _better_allocation(self, spec: EPDDeploymentSpec, p: Proposal, rate: float) -> str | None:
        """An allocation of the budget that the twin gives more goodput at ``rate`` with ``p``'s knobs."""
        from easerve_runtime.sim.runner import run_trial

        from easerve_operator.tuning.runners.sim import SimStageProfiler
        from easerve_operator.tuning.space import Candidate, apply_candidate, space_for

        try:
            prof = SimStageProfiler(spec)
            space = space_for(spec, prof.min_tp(), local_tp=prof.local_prefill_tp())
        except ValueError:
            return None
        tier = spec.slo.objective
        best, best_g = None, p.predicted_goodput * (1 + RECOMMEND_MARGIN)
        for a in space.allocations:
            if a.allocation() == spec.allocation:
                continue
            s = p.knobs.offload_ratio if p.knobs.offload_ratio in space.s_values(a) else 1.0
            try:
                cand = apply_candidate(spec, Candidate(a, p.knobs.batch_bound, s))
            except ValueError:
                continue
            g = float(run_trial(cand, rate, self.requests, 0)["goodput"][tier])
            if g > best_g:
                best, best_g = a.label, g
        return best

    def step(self, raw: Mapping[str, Any], spec: EPDDeploymentSpec, status: Mapping[str, Any] | None) -> AdaptStatus | None:
        """One observation; the ``status.adapt`` to write (None: nothing new to say).

        ``spec`` is the effective spec (tuned values in, the autopilot's own knobs not), ``status``
        the last ``status.adapt``."""
        from easerve_operator.tuning.runners.kube import time_scale

        pinned = pinned_knobs(raw, spec)
        key = (spec.allocation.label(), spec.tuning.adapt.model_dump_json(), pinned, spec.tuning.target_rate)
        if self.pilot is None or key != self.key:
            self.pilot, self.key = self._build(spec, pinned, status), key
        pilot = self.pilot
        try:
            seen = self.rates.observe(spec)
        except Exception as exc:  # noqa: BLE001 - Prometheus hiccups: say so, keep the knobs
            return self._status(pilot, pinned, None, None, f"no observation: {type(exc).__name__}: {exc}"[:300])
        if seen is None:
            return self._status(pilot, pinned, None, None, "no traffic observed yet")
        k = time_scale(spec)
        rate, good = seen[0] / k, seen[1]
        now = self.clock()
        d = pilot.observe(now, rate, good)
        if d is not None:
            self.decisions.append(decision_status(d, now))
            self.decisions = self.decisions[-KEEP_DECISIONS:]
            log.info("autopilot: %s B %d -> %d, s %g -> %g (%s)", d.kind, d.old.batch_bound, d.new.batch_bound,
                     d.old.offload_ratio, d.new.offload_ratio, d.reason)
        return self._status(pilot, pinned, rate, good, None, now)

    def _status(self, pilot: Autopilot, pinned: frozenset[str], rate: float | None, good: float | None,
                message: str | None, now: float | None = None) -> AdaptStatus:
        return AdaptStatus(
            knobs=AdaptKnobs(batch_bound=pilot.knobs.batch_bound, offload_ratio=pilot.knobs.offload_ratio),
            reference_rate=pilot.reference_rate,
            observed_rate=rate,
            good_fraction=good,
            observed_at=_iso(now) if now is not None else None,
            pinned=sorted(pinned),
            decisions=[AdaptDecisionStatus.model_validate(x) for x in self.decisions],
            calibration=self.calibration,
            message=message,
        )


def decision_status(d: Decision, now: float) -> dict[str, Any]:
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
    }
