"""Batcher properties under a fake clock: bounds, FIFO, conservation, max-age, reasons, wakeups."""

from __future__ import annotations

import math
import random

import pytest
from easerve_runtime.api import EncodeSpec
from easerve_runtime.policies.batcher import (
    Dispatch,
    DispatchReason,
    EagerBatcher,
    FixedTimeoutBatcher,
    PoissonGapBatcher,
    RateEstimator,
    make_batcher,
)
from hypothesis import given, settings
from hypothesis import strategies as st

gaps = st.lists(st.floats(min_value=0.0, max_value=0.2, allow_nan=False), min_size=1, max_size=60)
bounds = st.integers(min_value=1, max_value=9)


def _make(kind: str, b: int, max_age: float, q: float = 0.5):
    if kind == "gap":
        return PoissonGapBatcher(b, max_age, gap_quantile=q, half_life_s=0.5)
    if kind == "timeout":
        return FixedTimeoutBatcher(b, max_age)
    return EagerBatcher(b)


def _run_free_encoder(batcher, arrival_gaps):
    """Drive with an always-free encoder: poll exactly at every next_wakeup and after arrivals.

    Returns the dispatches and each item's arrival time (items are their own indices).
    """
    arrivals = []
    t = 0.0
    for g in arrival_gaps:
        t += g
        arrivals.append(t)
    out: list[Dispatch[int]] = []
    now = 0.0

    def drain_until(limit: float) -> None:
        nonlocal now
        while True:
            w = batcher.next_wakeup(now)
            if w is None or w > limit:
                return
            assert w >= now
            now = w
            d = batcher.poll(now)
            assert d is not None, "poll at next_wakeup() must dispatch"
            out.append(d)

    for i, at in enumerate(arrivals):
        drain_until(at)
        now = at
        batcher.on_arrival(i, now)
        d = batcher.poll(now)
        if d is not None:
            out.append(d)
    drain_until(math.inf)
    return out, arrivals


@settings(max_examples=120, deadline=None)
@given(
    kind=st.sampled_from(["gap", "timeout", "eager"]),
    b=bounds,
    arrival_gaps=gaps,
    max_age=st.floats(min_value=0.001, max_value=0.3),
    q=st.floats(min_value=0.05, max_value=0.95),
)
def test_free_encoder_conserves_fifo_bounds_and_max_age(kind, b, arrival_gaps, max_age, q):
    batcher = _make(kind, b, max_age, q)
    out, arrivals = _run_free_encoder(batcher, arrival_gaps)
    flat = [x for d in out for x in d.items]
    assert flat == list(range(len(arrivals)))  # nothing lost, duplicated or reordered
    assert batcher.pending == 0
    assert batcher.next_wakeup(1e9) is None
    for d in out:
        assert 1 <= len(d.items) <= b
        # nobody waits past max age (timeout) when poll is called at next_wakeup()
        assert d.at <= arrivals[d.items[0]] + max_age
        if d.reason == DispatchReason.FULL:
            assert len(d.items) == b
        if d.reason == DispatchReason.MAX_AGE:
            assert d.at == arrivals[d.items[0]] + max_age
        if d.reason == DispatchReason.TIMEOUT:
            assert d.at == arrivals[d.items[0]] + max_age
    allowed = {
        "gap": {DispatchReason.FULL, DispatchReason.MAX_AGE, DispatchReason.GAP},
        "timeout": {DispatchReason.FULL, DispatchReason.TIMEOUT},
        "eager": {DispatchReason.FULL, DispatchReason.EAGER},
    }[kind]
    assert {d.reason for d in out} <= allowed


def _oracle_reason(kind, batcher, now, last_arrival, b, max_age):
    """The reason a poll at ``now`` must give, from observable state only (None: no dispatch)."""
    n = batcher.pending
    if n == 0:
        return None
    if n >= b:
        return DispatchReason.FULL
    if kind == "eager":
        return DispatchReason.EAGER
    if now >= batcher.oldest_arrival + max_age:
        return DispatchReason.MAX_AGE if kind == "gap" else DispatchReason.TIMEOUT
    if kind == "gap" and last_arrival is not None and now >= last_arrival + batcher.gap_s():
        return DispatchReason.GAP
    return None


ops = st.lists(
    st.tuples(st.sampled_from(["arrive", "poll", "wake"]), st.floats(min_value=0.0, max_value=0.05)),
    min_size=1,
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["gap", "timeout", "eager"]),
    b=bounds,
    seq=ops,
    max_age=st.floats(min_value=0.001, max_value=0.1),
)
def test_any_interleaving_keeps_invariants(kind, b, seq, max_age):
    """Arbitrary arrivals and polls (a busy encoder = no polls) never lose, duplicate or overfill."""
    batcher = _make(kind, b, max_age)
    now, nxt, got = 0.0, 0, []
    last_arrival = None
    for op, dt in seq:
        now += dt
        before = batcher.pending
        if op == "arrive":
            last_arrival = now
            batcher.on_arrival(nxt, now)
            nxt += 1
            assert batcher.pending == before + 1
            continue
        if op == "wake":
            w = batcher.next_wakeup(now)
            if w is None:
                assert before == 0
                continue
            assert w >= now
            # between now and the wakeup, with no arrival, nothing may dispatch unless FULL
            d_early = batcher.poll(now) if w > now else None
            assert d_early is None
            now = w
        expected = _oracle_reason(kind, batcher, now, last_arrival, b, max_age)
        d = batcher.poll(now)
        if d is None:
            assert expected is None
            assert batcher.pending == before
            continue
        assert d.reason == expected
        assert d.at == now
        assert 1 <= len(d.items) <= b
        assert len(d.items) == min(b, before)
        assert batcher.pending == before - len(d.items)
        got.extend(d.items)
    while batcher.pending:
        now = batcher.next_wakeup(now)
        d = batcher.poll(now)
        assert d is not None
        got.extend(d.items)
    assert got == list(range(nxt))


def test_reasons_full_gap_and_max_age():
    b = PoissonGapBatcher(batch_bound=3, max_age_s=0.050, gap_quantile=0.5, half_life_s=10.0)
    # the very first request: λ̂ unknown -> g = inf -> waits for max age
    b.on_arrival("a", 0.0)
    assert b.rate_estimate == 0.0 and math.isinf(b.gap_s())
    assert b.poll(0.049) is None
    assert b.next_wakeup(0.0) == pytest.approx(0.050)
    d = b.poll(0.050)
    assert d is not None and d.reason == DispatchReason.MAX_AGE and d.items == ("a",)
    # three quick arrivals fill the batch
    for i, t in enumerate((1.0, 1.001, 1.002)):
        b.on_arrival(i, t)
    d = b.poll(1.002)
    assert d is not None and d.reason == DispatchReason.FULL and d.items == (0, 1, 2)
    # a lone arrival after a steady 10 ms cadence leaves after the gap g = ln2 * mean gap
    b2 = PoissonGapBatcher(batch_bound=100, max_age_s=1.0, gap_quantile=0.5, half_life_s=10.0)
    t = 0.0
    for _ in range(50):
        b2.on_arrival(None, t)
        t += 0.010
        b2.poll(t - 0.010)  # encoder busy until now: nothing due yet at arrival time
    assert b2.rate_estimate == pytest.approx(100.0, rel=1e-9)
    assert b2.gap_s() == pytest.approx(math.log(2) * 0.010, rel=1e-9)
    last = t - 0.010
    w = b2.next_wakeup(last)
    assert w == pytest.approx(last + math.log(2) * 0.010)
    assert b2.poll(w - 1e-6) is None
    d = b2.poll(w)
    assert d is not None and d.reason == DispatchReason.GAP and len(d.items) == 50


def test_gap_tightens_with_load_and_is_bounded_by_max_age():
    def gap_at(rate: float) -> float:
        b = PoissonGapBatcher(batch_bound=10_000, max_age_s=0.05, half_life_s=5.0)
        rng = random.Random(7)
        t = 0.0
        for _ in range(4000):
            t += rng.expovariate(rate)
            b.on_arrival(0, t)
        assert b.rate_estimate == pytest.approx(rate, rel=0.25)
        # the wakeup never exceeds max age from the oldest pending
        assert b.next_wakeup(b.oldest_arrival) <= b.oldest_arrival + 0.05
        return b.gap_s()

    g_low, g_high = gap_at(20.0), gap_at(400.0)
    assert g_high < g_low


def test_rate_estimator_decays_in_time_and_is_unbiased():
    est = RateEstimator(half_life_s=1.0)
    assert est.rate == 0.0 and math.isinf(est.mean_gap)
    rng = random.Random(3)
    t, rates = 0.0, []
    for _ in range(20_000):
        t += rng.expovariate(50.0)
        est.observe(t)
        rates.append(est.rate)
    mean = sum(rates[1000:]) / len(rates[1000:])
    assert mean == pytest.approx(50.0, rel=0.05)  # no length bias (a gap-weighted EWMA gives ~25)
    # after a rate change, the estimate follows within a few half-lives (measured in seconds)
    for _ in range(2000):
        t += rng.expovariate(500.0)
        est.observe(t)
    assert est.rate == pytest.approx(500.0, rel=0.25)
    with pytest.raises(ValueError, match="backwards"):
        est.observe(t - 1.0)


def test_fixed_timeout_and_eager():
    f = FixedTimeoutBatcher(batch_bound=4, timeout_s=0.010)
    f.on_arrival("x", 0.0)
    f.on_arrival("y", 0.005)
    assert f.poll(0.009) is None
    assert f.next_wakeup(0.0) == pytest.approx(0.010)
    d = f.poll(0.010)
    assert d is not None and d.reason == DispatchReason.TIMEOUT and d.items == ("x", "y")
    e = EagerBatcher(batch_bound=2)
    assert e.poll(0.0) is None and e.next_wakeup(0.0) is None
    for i in range(3):
        e.on_arrival(i, 0.0)
    assert e.next_wakeup(0.0) == 0.0
    d1, d2 = e.poll(0.0), e.poll(0.0)
    assert d1 is not None and d1.reason == DispatchReason.FULL and d1.items == (0, 1)
    assert d2 is not None and d2.reason == DispatchReason.EAGER and d2.items == (2,)


def test_make_batcher_from_spec_converts_ms():
    b = make_batcher(EncodeSpec(batch_bound=5, dispatch="poisson-gap", max_age_ms=20, gap_quantile=0.3))
    assert isinstance(b, PoissonGapBatcher)
    assert b.batch_bound == 5 and b.max_age_s == pytest.approx(0.020) and b.gap_quantile == 0.3
    f = make_batcher(EncodeSpec(dispatch="fixed-timeout", timeout_ms=7))
    assert isinstance(f, FixedTimeoutBatcher) and f.timeout_s == pytest.approx(0.007)
    assert isinstance(make_batcher(EncodeSpec(dispatch="eager", batch_bound=1)), EagerBatcher)


@pytest.mark.parametrize(
    "ctor, field",
    [
        (lambda: PoissonGapBatcher(0, 0.05), "batch_bound"),
        (lambda: PoissonGapBatcher(2, 0.0), "max_age_s"),
        (lambda: PoissonGapBatcher(2, 0.05, gap_quantile=1.0), "gap_quantile"),
        (lambda: PoissonGapBatcher(2, 0.05, half_life_s=0), "half_life_s"),
        (lambda: FixedTimeoutBatcher(2, -1), "timeout_s"),
        (lambda: EagerBatcher(True), "batch_bound"),
    ],
)
def test_bad_parameters_name_the_field(ctor, field):
    with pytest.raises(ValueError, match=field):
        ctor()
