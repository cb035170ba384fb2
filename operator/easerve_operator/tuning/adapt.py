"""The autopilot: follow the observed arrival rate with live B and s changes (docs/adapt.md).

HAS tunes once, for one declared rate Λ. Traffic drifts, and the best encode batch bound B and
offload ratio s move with it. Both are live knobs (``easerve_runtime.policies.knobs``): the
encode workers take them without a restart. This module decides WHEN to change them and TO WHAT.
It is a pure state machine with an injected clock: the caller feeds ``observe(now, rate,
good_fraction)`` samples (what the operator reads from Prometheus: the arrival rate over its
scrape window, and goodput / arrival rate over the same window), and it returns a ``Decision``
or None. The caller applies decisions (through the ConfigMap on the cluster, through
``apply_knobs`` on the twin) and records them in status.

The loop:

1. **Band.** The configuration in force was tuned for a reference rate r. A sample is out of band
   when rate > r·(1+band) or rate < r/(1+band) (symmetric in log space, so a doubling and a
   halving are the same distance).
2. **Hold (hysteresis).** A re-tune needs every sample of the last ``hold_s`` seconds out of band
   on the same side. A noisy rate that pokes out and back never triggers, and after a re-tune
   the reference becomes the observed rate, so it must move a whole band again: two thresholds,
   not one. The rate re-tuned for is the median of the held samples whose whole averaging window
   (``sample_window_s``, the shell's ``rate()`` window) lies inside the out-of-band run; until one
   does, the decision waits (a sample that straddles the step reads a blend of old and new).
3. **Minimum interval.** No two applied changes within ``min_interval_s``.
4. **Re-tune.** ``retune(rate, pinned)`` answers the best (B, s) for that rate with its predicted
   goodput (on the twin: seconds, a small grid). Explicit spec values are ``pinned`` and kept.
   An answer equal to the knobs in force is no change: the reference moves, nothing is applied.
   Every re-tune, applied or not, is kept in ``Autopilot.retunes`` (status shows them: a step that
   moved no knob is then told apart from a step the loop never saw).
5. **Guard rail.** The good fraction during the hold (old knobs, already at the new rate) is the
   baseline. Over ``guard_window_s`` after the change, if the mean good fraction falls below
   baseline − ``rollback_tolerance``, the old knobs come back (a ``rollback`` decision) and the
   reference becomes the current rate, so the same change is not retried at once. If the rate
   leaves the new band during the guard window, before and after are not like for like and the
   change is kept (the band logic re-tunes instead).
6. **Allocation changes** (only where the caller allows them: ``spec.tuning.adapt.allowAllocationChanges``
   with the allocation left unset). A re-tuner may answer another allocation to *apply*
   (``Proposal.reallocate``, with the knobs chosen for it): the decision then carries the old and
   new allocation, and applying it rolls pods. While the roll runs the caller says the deployment
   is not ``settled``: no decision is made and the guard window has not started (the good fraction
   of a rolling deployment says nothing about the new allocation); it starts once the new pods
   serve. A rollback restores the old allocation with the old knobs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from easerve_runtime.api import AdaptSpec
from easerve_runtime.sim.latency import StageScales


@dataclass(frozen=True)
class Knobs:
    """The live knobs the autopilot moves."""

    batch_bound: int
    offload_ratio: float


@dataclass(frozen=True)
class Proposal:
    """A re-tuner's answer for one rate."""

    knobs: Knobs
    predicted_goodput: float
    allocation: str | None = None
    """An allocation that would do better (recommended only, unless the spec allows rolls)."""
    reallocate: str | None = None
    """An allocation to apply (a roll), ``knobs`` being the ones chosen for it; None: keep the one
    that runs. Only a caller that may apply allocations answers one."""


Retuner = Callable[[float, frozenset[str]], Proposal]
"""``retune(rate, pinned) -> Proposal``; ``pinned`` names knobs to keep ("batch_bound", "offload_ratio")."""


@dataclass(frozen=True)
class AdaptParams:
    """``spec.tuning.adapt`` in seconds and fractions (see ``AdaptSpec`` for each field)."""

    band: float = 0.3
    hold_s: float = 30.0
    min_interval_s: float = 120.0
    guard_window_s: float = 60.0
    rollback_tolerance: float = 0.05
    settle_s: float = 0.0
    """After an allocation change's roll: seconds before the live figures count again (the rate
    windows and stage costs must cover the new pods only, not a mix of old and new)."""
    sample_window_s: float = 0.0
    """Each sample averages the rate over this many seconds before it (the shell's ``rate()``
    window). The rate a re-tune is made for is taken only from samples whose whole window lies
    inside the out-of-band run: a sample that straddles the step reads a blend of the old and the
    new rate (on CI, 0.255 req/s for a ~0.5 step from idle, with an 8 s hold under a 10 s window)."""

    @classmethod
    def from_spec(cls, a: AdaptSpec) -> AdaptParams:
        return cls(
            band=a.band,
            hold_s=a.hold_seconds,
            min_interval_s=a.min_interval_seconds,
            guard_window_s=a.guard_window_seconds,
            rollback_tolerance=a.rollback_tolerance,
        )


@dataclass(frozen=True)
class Decision:
    """One change, as recorded in status: when, why, from what to what, what the twin expects."""

    at: float
    kind: str  # "retune" | "rollback"
    observed_rate: float
    reference_rate: float
    old: Knobs
    new: Knobs
    predicted_goodput: float | None
    reason: str
    recommended_allocation: str | None = None
    old_allocation: str | None = None
    """The allocation before an applied allocation change (None: the deployment's own)."""
    new_allocation: str | None = None
    """The allocation applied (None with ``old_allocation`` None: no allocation change)."""

    @property
    def reallocates(self) -> bool:
        return self.old_allocation != self.new_allocation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Retune:
    """One re-tune the band triggered, applied or not.

    Why it is kept beside the decisions: near a tie the re-tuner often answers the knobs already
    in force, and then nothing changes. Without a record of that answer, a load step that moved no
    knob looks the same as a loop that never noticed the step."""

    at: float
    observed_rate: float
    reference_rate: float
    side: int
    """+1: the rate was above the band around ``reference_rate``; -1: below it."""
    answer: Knobs
    """The knobs in force after it: the re-tuner's answer, pinned knobs kept."""
    predicted_goodput: float
    applied: bool
    """False: the answer was the knobs in force (nothing to apply)."""


@dataclass
class _Guard:
    decision: Decision
    baseline: float | None
    until: float
    fractions: list[float] = field(default_factory=list)
    comparable: bool = True
    started: bool = True
    """False while the deployment rolls to a new allocation: the window starts once it settles."""
    count_from: float = -math.inf
    """Good fractions before this time are not counted (the settle time after a roll)."""


class Autopilot:
    """The state machine of the module docstring. Feed ``observe``; apply what it returns."""

    def __init__(
        self,
        params: AdaptParams,
        knobs: Knobs,
        tuned_rate: float,
        retune: Retuner,
        *,
        pinned: frozenset[str] = frozenset(),
    ) -> None:
        if not tuned_rate > 0:
            raise ValueError(f"tuned_rate must be > 0, got {tuned_rate}")
        self.params = params
        self.knobs = knobs
        self.reference_rate = float(tuned_rate)
        self.retune = retune
        self.pinned = pinned
        self.allocation: str | None = None
        """The allocation applied by a change (a label; None: the deployment's own)."""
        self.decisions: list[Decision] = []
        self.retunes: list[Retune] = []
        """Every re-tune since the caller last drained the list, applied or kept."""
        self._samples: deque[tuple[float, float, float | None]] = deque()
        self._last_change: float | None = None
        self._guard: _Guard | None = None
        self._quiet_until = -math.inf
        self._rolling = False

    # -- band ---------------------------------------------------------------------------------
    def side(self, rate: float) -> int:
        """+1 above the band, -1 below it, 0 inside."""
        hi = self.reference_rate * (1.0 + self.params.band)
        lo = self.reference_rate / (1.0 + self.params.band)
        return 1 if rate > hi else -1 if rate < lo else 0

    def _held_out(self, now: float) -> int:
        """The side every sample of the last ``hold_s`` is on (0 if mixed, in band, or too short)."""
        if not self._samples or now - self._samples[0][0] < self.params.hold_s:
            return 0
        sides = {self.side(r) for t, r, _ in self._samples if t >= now - self.params.hold_s}
        if len(sides) != 1:
            return 0
        return sides.pop()

    def _run_start(self, side: int) -> float:
        """Time of the first sample of the current run of samples on ``side`` (the newest ones)."""
        start = self._samples[-1][0]
        for t, r, _ in reversed(self._samples):
            if self.side(r) != side:
                break
            start = t
        return start

    # -- the loop -------------------------------------------------------------------------------
    def observe(self, now: float, rate: float, good_fraction: float | None = None, *,
                settled: bool = True) -> Decision | None:
        """One sample: the arrival rate (req/s) and goodput / arrival rate over the same window.
        ``settled``: False while an applied allocation change still rolls (rule 6)."""
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(f"rate must be a finite number >= 0, got {rate}")
        if not settled:  # a roll runs: nothing is decided, no guard window runs
            self._rolling = True
            return None
        if self._rolling:  # the roll just ended: what was seen before it, or in its wake, is stale
            self._rolling = False
            self._samples.clear()
            self._quiet_until = now + self.params.settle_s
        g = self._guard
        if g is not None and not g.started:  # an allocation change's window starts after its roll
            g.started = True
            g.count_from = max(now, self._quiet_until)
            g.until = g.count_from + self.params.guard_window_s
        if now < self._quiet_until:
            return None
        self._samples.append((now, rate, good_fraction))
        keep = max(self.params.hold_s + self.params.sample_window_s, self.params.guard_window_s)
        while self._samples and self._samples[0][0] < now - keep:
            self._samples.popleft()

        if self._guard is not None:
            return self._check_guard(now, rate, good_fraction)

        side = self._held_out(now)
        if side == 0:
            return None
        if self._last_change is not None and now - self._last_change < self.params.min_interval_s:
            return None
        start = self._run_start(side)
        held = [r for t, r, _ in self._samples
                if t >= now - self.params.hold_s and t >= start + self.params.sample_window_s]
        if not held:
            return None  # every sample of the run still blends in the rate before it: wait
        target = statistics.median(held)
        if not target > 0:
            # idle (the load stopped, or has not started): there is no rate to tune for, and
            # knobs picked for zero would be wrong for whatever comes next; keep them
            return None
        prop = self.retune(target, self.pinned)
        realloc = prop.reallocate is not None and prop.reallocate != self.allocation
        new_alloc = prop.reallocate if realloc else self.allocation
        if realloc:  # the knobs chosen for the new layout (the re-tuner kept the explicit ones)
            new = prop.knobs
        else:
            new = Knobs(
                self.knobs.batch_bound if "batch_bound" in self.pinned else prop.knobs.batch_bound,
                self.knobs.offload_ratio if "offload_ratio" in self.pinned else prop.knobs.offload_ratio,
            )
        old_ref = self.reference_rate
        self.reference_rate = target
        applied = new != self.knobs or realloc
        self.retunes.append(Retune(now, target, old_ref, side, new, prop.predicted_goodput, applied))
        if not applied:
            return None  # already the best for this rate: the band moves, nothing to apply
        fr = [g for t, _, g in self._samples if t >= now - self.params.hold_s and g is not None]
        d = Decision(
            at=now,
            kind="retune",
            observed_rate=target,
            reference_rate=old_ref,
            old=self.knobs,
            new=new,
            predicted_goodput=prop.predicted_goodput,
            reason=f"rate {target:.3g} req/s {'above' if side > 0 else 'below'} the band around {old_ref:.3g} "
            f"(band {self.params.band:g}) for {self.params.hold_s:g}s",
            recommended_allocation=prop.allocation,
            old_allocation=self.allocation,
            new_allocation=new_alloc,
        )
        self._apply(d, now)
        self._guard = _Guard(d, statistics.fmean(fr) if fr else None, now + self.params.guard_window_s,
                             started=not realloc)
        return d

    def _apply(self, d: Decision, now: float) -> None:
        self.knobs = d.new
        self.allocation = d.new_allocation
        self._last_change = now
        self.decisions.append(d)

    def _check_guard(self, now: float, rate: float, good_fraction: float | None) -> Decision | None:
        g = self._guard
        assert g is not None
        if good_fraction is not None and now >= g.count_from:
            g.fractions.append(good_fraction)
        if self.side(rate) != 0:
            g.comparable = False
        if now < g.until:
            return None
        self._guard = None
        if g.baseline is None or not g.fractions or not g.comparable:
            # nothing measured, or the load moved out of the band meanwhile (before and after are
            # then not like for like): keep the change, the band logic takes it from here
            return None
        after = statistics.fmean(g.fractions)
        if after >= g.baseline - self.params.rollback_tolerance:
            return None
        d = Decision(
            at=now,
            kind="rollback",
            observed_rate=rate,
            reference_rate=self.reference_rate,
            old=self.knobs,
            new=g.decision.old,
            predicted_goodput=None,
            old_allocation=self.allocation,
            new_allocation=g.decision.old_allocation,
            reason=f"good fraction {after:.3f} over {self.params.guard_window_s:g}s after the change at "
            f"{g.decision.at:g}s < {g.baseline:.3f} before it - {self.params.rollback_tolerance:g}",
        )
        self._apply(d, now)
        self.reference_rate = rate if rate > 0 else self.reference_rate
        return d


def grid_retuner(
    evaluate: Callable[[Knobs, float], tuple[float, float]],
    current: Callable[[], Knobs],
    batch_bounds: tuple[int, ...],
    ratios: tuple[float, ...],
    headroom: float = 0.0,
) -> Retuner:
    """A re-tuner over a small (B, s) grid: ``evaluate(knobs, rate) -> (goodput, mean TTFT)``.

    ``headroom``: candidates are scored at rate·(1+headroom). Pass the band: the knobs stay in
    force until the rate leaves the band, so they must hold at its top edge, not only at its
    centre (a pick that is best at r but collapses at r·(1+band) is a bad bet while the load rises).

    The pick is the highest goodput; within 1 % of it the lowest mean TTFT (HAS's selection rule),
    so near-ties at light load do not flip the knobs for nothing. Pinned knobs keep their current
    value and are not searched.
    """

    def retune(rate: float, pinned: frozenset[str]) -> Proposal:
        cur = current()
        bs = (cur.batch_bound,) if "batch_bound" in pinned else batch_bounds
        ss = (cur.offload_ratio,) if "offload_ratio" in pinned else ratios
        at = rate * (1.0 + headroom)
        scored = [(evaluate(Knobs(b, s), at), Knobs(b, s)) for b in bs for s in ss]
        best_g = max(g for (g, _), _ in scored)
        near = [(ttft, k, g) for (g, ttft), k in scored if g >= best_g * 0.99]
        ttft, k, g = min(near, key=lambda x: (x[0], x[1].batch_bound, x[1].offload_ratio))
        return Proposal(k, g)

    return retune


def with_knobs(spec: Any, k: Knobs) -> Any:
    """``spec`` with these live knobs (the allocation and everything else as they are)."""
    return spec.model_copy(
        update={
            "encode": spec.encode.model_copy(update={"batch_bound": k.batch_bound}),
            "offload": spec.offload.model_copy(update={"ratio": k.offload_ratio}),
        }
    )


def twin_evaluator(
    spec: Any, tier: str, requests: int = 200, seed: int = 0, scales: Callable[[], StageScales] | None = None
) -> Callable[[Knobs, float], tuple[float, float]]:
    """``evaluate(knobs, rate)`` on the twin: the spec with these live knobs, Poisson at ``rate``.

    The allocation and layout stay the spec's (only live knobs move), so local prefill workers
    exist whenever the spec has them, as they do in the running pods. ``scales``: the live
    calibration in force when a call is made (``stage_scales``), read at each call. Results are
    cached per knobs, rate and calibration.
    """
    from easerve_runtime.profiles import spec_profile
    from easerve_runtime.sim.latency import StageModel
    from easerve_runtime.sim.runner import run_trial

    cache: dict[tuple[Any, ...], tuple[float, float]] = {}
    models: dict[StageScales, StageModel] = {}

    def evaluate(k: Knobs, rate: float) -> tuple[float, float]:
        sc = scales() if scales is not None else StageScales()
        key = (k.batch_bound, k.offload_ratio, round(rate, 3), sc)
        if key not in cache:
            model = None
            if sc != StageScales():
                model = models.get(sc)
                if model is None:
                    model = models[sc] = StageModel(spec_profile(spec), sc)
            m = run_trial(with_knobs(spec, k), rate, requests, seed, model=model)
            cache[key] = (float(m["goodput"][tier]), float(m["ttft_mean"] or math.inf))
        return cache[key]

    return evaluate


@dataclass(frozen=True)
class LiveCosts:
    """Stage costs a running deployment measured over a window (real seconds; None: not measured).

    What the autopilot calibrates its twin with: encode from ``easerve_encode_batch_seconds`` against
    ``easerve_encode_profile_seconds_total`` (what the profile predicts for the same micro-batches,
    summed by the worker, which knows each batch's items and SM share), decode from
    ``easerve_tpot_seconds`` (the mean TPOT, which the twin predicts for the same knobs and rate).
    Prefill has no signal of its own (TTFT mixes queueing, encode and transfer), so it keeps the
    profile's cost."""

    encode_batch_s: float | None = None
    encode_profile_s: float | None = None
    """The profile's mean time for the same micro-batches (None: a worker without a profile)."""
    encode_items_per_batch: float | None = None
    encode_share: float | None = None
    tpot_s: float | None = None


SCALE_BOUNDS = (0.25, 4.0)
"""A measured cost this far from the profile is a wrong profile, not a calibration: clamp it."""
SCALE_STEP = 0.02
"""Scales are rounded to this (the twin's results are cached per calibration)."""


def _ratio(measured: float | None, predicted: float | None, k: float) -> float | None:
    if measured is None or predicted is None or not (measured > 0 and predicted > 0):
        return None
    if not (math.isfinite(measured) and math.isfinite(predicted)):
        return None
    lo, hi = SCALE_BOUNDS
    r = round(round(measured * k / predicted / SCALE_STEP) * SCALE_STEP, 4)
    return min(hi, max(lo, r))


def stage_scales(
    costs: LiveCosts,
    predicted_encode_s: Callable[[int, float], float],
    predicted_tpot_s: float | None,
    time_scale: float = 1.0,
    prev: StageScales | None = None,
) -> StageScales:
    """The twin's stage-cost multipliers that make it match what the deployment measured.

    ``predicted_encode_s(items, share)``: the profile's time for one micro-batch (unscaled), the
    fallback when the workers do not report ``encode_profile_s``: it is taken at the mean batch and
    mean share, and the encoder's cost is convex in the share (a batch at 30 % of the SMs takes
    far more than 3x one at the whole GPU), so it misses by tens of per cent where the split moves;
    ``predicted_tpot_s``: the uncalibrated twin's mean TPOT at the knobs and rate in force;
    ``time_scale``: a sped-up sim deployment's factor (measured seconds × k = model seconds).
    A stage without a measurement keeps ``prev``'s scale (1.0 at first)."""
    prev = prev or StageScales()
    enc = None
    if costs.encode_batch_s is not None and costs.encode_profile_s:
        enc = _ratio(costs.encode_batch_s, costs.encode_profile_s, time_scale)
    elif costs.encode_batch_s is not None and costs.encode_items_per_batch:
        items = max(1, round(costs.encode_items_per_batch))
        share = min(1.0, max(0.05, costs.encode_share or 1.0))
        enc = _ratio(costs.encode_batch_s, predicted_encode_s(items, share), time_scale)
    dec = _ratio(costs.tpot_s, predicted_tpot_s, time_scale)
    return StageScales(
        encode=enc if enc is not None else prev.encode,
        prefill=prev.prefill,
        decode=dec if dec is not None else prev.decode,
    )
