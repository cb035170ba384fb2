"""The autopilot's state machine under an injected clock: band exit, hysteresis against a noisy
rate, minimum interval, pinned knobs, and the guard rail's rollback."""

from __future__ import annotations

import random

import pytest
from easerve_operator.tuning.adapt import (
    AdaptParams,
    Autopilot,
    Knobs,
    Proposal,
    grid_retuner,
)
from easerve_runtime.api import AdaptSpec, load_manifest

START = Knobs(8, 0.5)


class Table:
    """A re-tuner that answers from a rate -> knobs rule and remembers its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, frozenset[str]]] = []

    def __call__(self, rate: float, pinned: frozenset[str]) -> Proposal:
        self.calls.append((rate, pinned))
        return Proposal(Knobs(16 if rate > 3 else 4, 0.7 if rate > 3 else 0.3), predicted_goodput=rate * 0.9)


def _pilot(**kw: float) -> tuple[Autopilot, Table]:
    t = Table()
    p = AdaptParams(**{"band": 0.3, "hold_s": 10, "min_interval_s": 60, "guard_window_s": 20, **kw})
    return Autopilot(p, START, tuned_rate=1.0, retune=t), t


def feed(ap: Autopilot, t0: float, t1: float, rate, good=None, dt: float = 1.0):
    out = []
    t = t0
    while t < t1:
        r = rate(t) if callable(rate) else rate
        g = good(t) if callable(good) else good
        d = ap.observe(t, r, g)
        if d is not None:
            out.append(d)
        t += dt
    return out


def test_in_band_never_retunes():
    ap, t = _pilot()
    assert feed(ap, 0, 300, lambda x: 1.0 + 0.25 * ((x % 2) - 0.5)) == []
    assert t.calls == []


def test_band_exit_held_retunes_once_with_the_observed_rate():
    ap, t = _pilot()
    ds = feed(ap, 0, 10, 1.0) + feed(ap, 10, 40, 4.0)
    assert len(ds) == 1
    d = ds[0]
    assert d.kind == "retune" and d.at == 20  # 10 s held out of band (samples 10..20)
    assert d.old == START and d.new == Knobs(16, 0.7) and d.observed_rate == 4.0
    assert d.reference_rate == 1.0 and d.predicted_goodput == pytest.approx(3.6)
    assert ap.knobs == Knobs(16, 0.7) and ap.reference_rate == 4.0
    assert len(t.calls) == 1


def test_a_rate_window_that_straddles_the_step_is_not_the_rate_tuned_for():
    """Each sample is the mean rate over the shell's 10 s window: after a step from 1 to 0.5 req/s
    the samples ramp down for 10 s. With the window known, the re-tune waits for samples whose
    whole window lies in the new level and tunes for 0.5; without it, an 8 s hold tunes for the
    blend of the ramp (what CI saw: 0.255 for a ~0.5 step)."""

    def windowed(t: float) -> float:  # rate() over [t - 10, t] of a step 1 -> 0.5 at t = 10
        after = min(10.0, max(0.0, t - 10.0))
        return (1.0 * (10.0 - after) + 0.5 * after) / 10.0

    got = {}
    for w in (0.0, 10.0):
        ap, _ = _pilot(hold_s=8, sample_window_s=w)
        (d,) = feed(ap, 0, 60, windowed)
        got[w] = d
    assert got[10.0].observed_rate == pytest.approx(0.5)
    assert got[0.0].observed_rate >= 0.55  # the blend of the ramp (samples 0.75 ... 0.55 ... 0.5)
    assert got[10.0].at > got[0.0].at  # it waited for one window more


def test_an_idle_deployment_keeps_its_knobs():
    """The load stops (rate 0 for longer than the hold): there is no rate to tune for, so no
    re-tune and no call to the re-tuner (the twin cannot even build a workload at 0 req/s)."""
    ap, t = _pilot()
    ds = feed(ap, 0, 10, 1.0) + feed(ap, 10, 200, 0.0)
    assert ds == [] and t.calls == []
    assert ap.knobs == START and ap.reference_rate == 1.0
    # traffic comes back out of the band: the autopilot tunes for it as usual
    ds = feed(ap, 200, 230, 4.0)
    assert [d.new for d in ds] == [Knobs(16, 0.7)] and ds[0].observed_rate == 4.0


def test_noisy_rate_poking_out_of_the_band_does_not_flap():
    """A rate that pokes out of the band at random, but never for the whole hold, never retunes
    (runs of out-of-band samples capped at 5 s < hold 10 s; 40 % of samples are out)."""
    ap, t = _pilot()
    rng = random.Random(7)
    run = 0

    def noisy(_x: float) -> float:
        nonlocal run
        out = rng.random() < 0.4 and run < 5
        run = run + 1 if out else 0
        return rng.uniform(1.35, 3.0) if out else rng.uniform(0.8, 1.25)

    ds = feed(ap, 0, 600, noisy)
    assert ds == [] and t.calls == []


def test_hysteresis_after_a_retune_needs_a_whole_band_again():
    ap, _ = _pilot(min_interval_s=0)
    ds = feed(ap, 0, 30, 4.0)
    assert len(ds) == 1 and ap.reference_rate == 4.0
    # back to 3.5: inside the new band around 4 -> nothing, although it was outside the old one
    assert feed(ap, 30, 200, 3.5) == []
    # a real drop (below 4/1.3) retunes
    ds = feed(ap, 200, 260, 2.0)
    assert len(ds) == 1 and ds[0].new == Knobs(4, 0.3)


def test_min_interval_spaces_changes():
    ap, _ = _pilot(min_interval_s=100)
    ds = feed(ap, 0, 30, 4.0) + feed(ap, 30, 200, 1.0)
    assert [d.at for d in ds] == [10, 110]  # the drop at 30 waits for the interval (10 + 100)


def test_same_answer_moves_the_band_without_a_change():
    t = Table()
    ap = Autopilot(AdaptParams(band=0.3, hold_s=5, min_interval_s=0), Knobs(16, 0.7), 4.0, t)
    assert feed(ap, 0, 20, 6.0) == []  # the table says (16, 0.7) for 6 too
    assert len(t.calls) == 1 and ap.reference_rate == 6.0 and ap.decisions == []


def test_every_retune_is_kept_applied_or_not():
    t = Table()
    ap = Autopilot(AdaptParams(band=0.3, hold_s=5, min_interval_s=0), Knobs(16, 0.7), 4.0, t)
    assert feed(ap, 0, 20, 6.0) == []  # the same answer: no decision, but a kept re-tune
    (kept,) = ap.retunes
    assert not kept.applied and kept.answer == Knobs(16, 0.7) and kept.side == 1
    assert (kept.at, kept.observed_rate, kept.reference_rate) == (5, 6.0, 4.0)
    assert kept.predicted_goodput == pytest.approx(5.4)
    ds = feed(ap, 20, 40, 1.0)  # a real drop: applied, and the record says what the decision did
    (d,) = ds
    applied = ap.retunes[-1]
    assert applied.applied and applied.side == -1 and applied.answer == d.new == Knobs(4, 0.3)
    assert (applied.at, applied.observed_rate, applied.reference_rate) == (d.at, d.observed_rate, d.reference_rate)
    assert len(ap.retunes) == 2 and len(t.calls) == 2


def test_pinned_knobs_are_kept():
    t = Table()
    ap = Autopilot(AdaptParams(hold_s=5, min_interval_s=0), START, 1.0, t, pinned=frozenset({"batch_bound"}))
    (d,) = feed(ap, 0, 20, 4.0)
    assert d.new == Knobs(8, 0.7) and t.calls[0][1] == frozenset({"batch_bound"})


def test_guard_rolls_back_a_change_that_made_goodput_worse():
    ap, _ = _pilot(rollback_tolerance=0.05)
    # before and during the hold (old knobs at the new rate) 90 % of requests are good; after: 60 %
    ds = feed(ap, 0, 11, 4.0, good=0.9) + feed(ap, 11, 60, 4.0, good=0.6)  # retune at 10
    assert [d.kind for d in ds] == ["retune", "rollback"]
    rb = ds[1]
    assert rb.at == 30 and rb.old == Knobs(16, 0.7) and rb.new == START
    assert ap.knobs == START and "0.600" in rb.reason and "0.900" in rb.reason
    assert [d.kind for d in ap.decisions] == ["retune", "rollback"]
    # the rolled-back change is not retried while the rate stays where it is
    assert feed(ap, 60, 400, 4.0, good=0.9) == []


def test_guard_keeps_a_change_that_helped_or_was_not_measured():
    ap, _ = _pilot()
    ds = feed(ap, 0, 11, 4.0, good=0.6) + feed(ap, 11, 80, 4.0, good=0.95)
    assert [d.kind for d in ds] == ["retune"] and ap.knobs == Knobs(16, 0.7)
    ap2, _ = _pilot()
    assert [d.kind for d in feed(ap2, 0, 80, 4.0)] == ["retune"]


def test_guard_does_not_judge_a_change_when_the_load_moved_meanwhile():
    ap, _ = _pilot(rollback_tolerance=0.05, min_interval_s=1000)
    ds = feed(ap, 0, 11, 4.0, good=0.9) + feed(ap, 11, 60, lambda t: 4.0 if t < 20 else 8.0, good=0.5)
    assert [d.kind for d in ds] == ["retune"]  # good fraction fell, but at twice the load


def test_headroom_scores_at_the_top_of_the_band():
    rates: list[float] = []

    def ev(k: Knobs, rate: float) -> tuple[float, float]:
        rates.append(rate)
        return rate, 1.0

    grid_retuner(ev, lambda: START, (1,), (0.5,), headroom=0.3)(2.0, frozenset())
    assert rates == [pytest.approx(2.6)]


def test_bad_inputs():
    with pytest.raises(ValueError, match="tuned_rate"):
        Autopilot(AdaptParams(), START, 0.0, Table())
    ap, _ = _pilot()
    with pytest.raises(ValueError, match="rate"):
        ap.observe(0.0, float("nan"))


def test_params_from_the_spec_field():
    _, spec = load_manifest("examples/llava-v1.6-34b.yaml")
    a = spec.tuning.adapt
    assert isinstance(a, AdaptSpec) and a.enabled is False and a.allow_allocation_changes is False
    p = AdaptParams.from_spec(a.model_copy(update={"hold_seconds": 5.0, "band": 0.5}))
    assert p.hold_s == 5.0 and p.band == 0.5 and p.min_interval_s == a.min_interval_seconds


def test_grid_retuner_prefers_goodput_then_ttft_and_keeps_pins():
    # goodput saturates at B >= 4; s = 0.5 best; TTFT lowest at B = 4
    def ev(k: Knobs, rate: float) -> tuple[float, float]:
        g = rate * (1.0 - abs(k.offload_ratio - 0.5)) * (1.0 if k.batch_bound >= 4 else 0.9)
        return g, 1.0 + abs(k.batch_bound - 4) * 0.1

    cur = Knobs(8, 1.0)
    rt = grid_retuner(ev, lambda: cur, (1, 4, 16), (0.0, 0.5, 1.0))
    p = rt(2.0, frozenset())
    assert p.knobs == Knobs(4, 0.5) and p.predicted_goodput == pytest.approx(2.0)
    assert rt(2.0, frozenset({"offload_ratio"})).knobs == Knobs(4, 1.0)


def test_stage_scales_match_the_measured_costs():
    """The twin's stage costs scaled to the live measurements: measured / predicted, in model time."""
    from easerve_operator.tuning.adapt import SCALE_BOUNDS, LiveCosts, stage_scales
    from easerve_runtime.sim.latency import StageScales

    def profile_encode(items: int, share: float) -> float:
        return 0.01 * items / share  # 10 ms an item on the whole GPU

    calls = []

    def predicted(items: int, share: float) -> float:
        calls.append((items, share))
        return profile_encode(items, share)

    # the encoder takes 1.5x the profile's time at its mean batch (4 items) and share (0.5); TPOT 0.8x
    costs = LiveCosts(encode_batch_s=1.5 * profile_encode(4, 0.5), encode_items_per_batch=4.2, encode_share=0.5,
                      tpot_s=0.8 * 0.030)
    sc = stage_scales(costs, predicted, predicted_tpot_s=0.030)
    assert calls == [(4, 0.5)]
    assert sc == StageScales(encode=1.5, prefill=1.0, decode=0.8)
    # a sim deployment 2x faster than modelled: its seconds are half the model's
    assert stage_scales(costs, profile_encode, 0.030, time_scale=2.0) == StageScales(3.0, 1.0, 1.6)
    # far off the profile: clamped; nothing measured: the previous calibration stays
    far = LiveCosts(encode_batch_s=100.0, encode_items_per_batch=1, tpot_s=1e-9)
    assert stage_scales(far, profile_encode, 0.03) == StageScales(SCALE_BOUNDS[1], 1.0, SCALE_BOUNDS[0])
    prev = StageScales(1.3, 1.0, 0.9)
    assert stage_scales(LiveCosts(), profile_encode, None, prev=prev) == prev
    assert stage_scales(LiveCosts(tpot_s=0.03), profile_encode, None, prev=prev) == prev  # no prediction
    # the workers' own sum of the profile's predictions for the batches they ran wins over the
    # mean-batch fallback (exact where the batch size and the SM share vary)
    exact = LiveCosts(encode_batch_s=0.06, encode_profile_s=0.05, encode_items_per_batch=4, encode_share=0.5)
    calls.clear()
    assert stage_scales(exact, predicted, None).encode == 1.2 and calls == []
    with pytest.raises(ValueError, match="StageScales.decode"):
        StageScales(decode=0.0)


def test_an_applied_allocation_change_waits_for_its_roll_before_the_guard_judges_it():
    """Rule 6: a re-tuner that may apply allocations answers one; the decision names the old and
    new allocation and takes the knobs chosen for it (even a knob pinned by the old layout). No
    decision and no guard verdict while the roll runs (``settled=False``); the guard window starts
    once the new pods serve, and a worse good fraction then rolls back allocation and knobs."""
    calls: list[float] = []

    def retune(rate: float, pinned: frozenset[str]) -> Proposal:
        calls.append(rate)
        return Proposal(Knobs(2, 1.0), predicted_goodput=3.0, allocation="3E-1P-1D", reallocate="3E-1P-1D")

    p = AdaptParams(band=0.3, hold_s=10, min_interval_s=0, guard_window_s=20)
    ap = Autopilot(p, START, tuned_rate=1.0, retune=retune, pinned=frozenset({"offload_ratio"}))
    ds = feed(ap, 0, 10, 1.0, good=0.9) + feed(ap, 10, 21, 4.0, good=0.9)
    assert len(ds) == 1
    d = ds[0]
    assert d.reallocates and d.old_allocation is None and d.new_allocation == "3E-1P-1D"
    assert d.new == Knobs(2, 1.0) and ap.allocation == "3E-1P-1D"
    # the roll: 60 s with a collapsing good fraction and a rate far out of the band: nothing happens
    for t in range(21, 81):
        assert ap.observe(t, 9.0 if t % 2 else 4.0, 0.0, settled=False) is None
    assert len(calls) == 1 and ap.decisions == [d]
    # settled at t=81: the guard window runs 81..101 at the new rate, and the result is worse
    out = feed(ap, 81, 110, 4.0, good=0.5)
    assert [x.kind for x in out] == ["rollback"] and out[0].at == 101
    rb = out[0]
    assert rb.old_allocation == "3E-1P-1D" and rb.new_allocation is None and rb.new == START
    assert ap.allocation is None and ap.knobs == START


def test_a_settled_allocation_change_that_holds_its_goodput_is_kept():
    def retune(rate: float, pinned: frozenset[str]) -> Proposal:
        return Proposal(Knobs(4, 0.5), predicted_goodput=3.0, reallocate="3E-1P-1D")

    ap = Autopilot(AdaptParams(band=0.3, hold_s=10, min_interval_s=0, guard_window_s=20), START, 1.0, retune)
    ds = feed(ap, 0, 10, 1.0, good=0.9) + feed(ap, 10, 21, 4.0, good=0.9)
    assert [d.new_allocation for d in ds] == ["3E-1P-1D"]
    assert all(ap.observe(t, 4.0, None, settled=False) is None for t in range(21, 40))
    assert feed(ap, 40, 80, 4.0, good=0.92) == [] and ap.allocation == "3E-1P-1D"


def test_after_a_roll_the_live_figures_must_settle_before_the_next_decision():
    """``settle_s``: the rate windows and stage costs read right after a roll mix the old and new
    pods, so for that long after it nothing is decided and the guard counts nothing; the hold
    then needs samples taken after the roll."""
    def retune(rate: float, pinned: frozenset[str]) -> Proposal:
        return Proposal(Knobs(4, 0.5), predicted_goodput=3.0, reallocate="A" if rate > 2 else "B")

    p = AdaptParams(band=0.3, hold_s=10, min_interval_s=0, guard_window_s=20, settle_s=30)
    ap = Autopilot(p, START, 1.0, retune)
    ds = feed(ap, 0, 11, 4.0, good=0.9)
    assert [d.new_allocation for d in ds] == ["A"] and ds[0].at == 10
    assert all(ap.observe(t, 0.5, None, settled=False) is None for t in range(11, 40))
    # settled at 40, the load already far below the band: nothing counts before 70 (settle), not
    # even the collapsed good fractions; the guard window is 70..90 (out of band: kept)
    assert feed(ap, 40, 70, 0.5, good=0.1) == []
    assert feed(ap, 70, 91, 0.5, good=0.9) == [] and ap.allocation == "A"
    # the hold is filled by samples taken after the settle time only: the re-tune comes at 91
    ds = feed(ap, 91, 110, 0.5, good=0.9)
    assert [d.new_allocation for d in ds] == ["B"] and ds[0].old_allocation == "A" and ds[0].at == 91
