"""Live knob changes on the pure policies: the batcher takes new parameters with nothing pending
lost or reordered, and the deficit router's split converges to the NEW ratio after a change."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from easerve_runtime.api import EncodeSpec
from easerve_runtime.policies.batcher import (
    DispatchReason,
    EagerBatcher,
    FixedTimeoutBatcher,
    PoissonGapBatcher,
    make_batcher,
    reconfigure_batcher,
)
from easerve_runtime.policies.router import DeficitRouter, Route
from hypothesis import given, settings
from hypothesis import strategies as st

ratios = st.one_of(
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    st.sampled_from([0.0, 1.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1 / 3]),
)


@settings(max_examples=100, deadline=None)
@given(
    plan=st.lists(st.tuples(ratios, st.integers(0, 400)), min_size=1, max_size=8),
    tail_s=ratios,
    tail_n=st.integers(1, 1500),
)
def test_split_after_any_retunes_tracks_the_new_ratio(plan, tail_s, tail_n):
    """Whatever happened before (any ratios, any lengths), after ``set_ratio(s)`` the next n
    decisions send exactly floor(d0 + n*s) remote, d0 in [0, 1) being the carried deficit: the
    error against n*s is below 1 for every n, so the long-run fraction converges to s at rate 1/n."""
    r = DeficitRouter(plan[0][0])
    for s, n in plan:
        r.set_ratio(s)
        for _ in range(n):
            r.decide()
        assert 0.0 <= r.deficit < 1.0
    r.set_ratio(tail_s)
    d0 = Fraction(r._d, r._den)  # the exact carried deficit (the gauge is its float)
    assert 0 <= d0 < 1
    remote = 0
    for i in range(1, tail_n + 1):
        remote += r.decide() == Route.REMOTE
        assert remote == math.floor(d0 + i * Fraction(tail_s))
    assert abs(remote / tail_n - tail_s) < 1.0 / tail_n + 1e-12
    # the counters keep counting across changes (the metrics are monotone)
    assert r.remote_count + r.local_count == sum(n for _, n in plan) + tail_n


def test_change_to_one_or_zero_is_immediate():
    r = DeficitRouter(0.5)
    for _ in range(7):
        r.decide()
    r.set_ratio(1.0)
    assert {r.decide() for _ in range(50)} == {Route.REMOTE}
    r.set_ratio(0.0)
    assert {r.decide() for _ in range(50)} == {Route.LOCAL}


def _fill(b, n, t0=0.0, dt=0.001):
    for i in range(n):
        b.on_arrival(i, t0 + i * dt)


def test_lowering_b_below_pending_dispatches_full_batches_in_order():
    b = make_batcher(EncodeSpec(batch_bound=8, max_age_ms=50))
    _fill(b, 6)
    same = reconfigure_batcher(b, EncodeSpec(batch_bound=4, max_age_ms=50))
    assert same is b and b.batch_bound == 4 and b.pending == 6
    d = b.poll(0.006)
    assert d is not None and d.items == (0, 1, 2, 3) and d.reason == DispatchReason.FULL
    assert b.pending == 2
    b.on_arrival(6, 0.007)
    d = b.poll(1.0)  # max age of item 4
    assert d is not None and d.items == (4, 5, 6)


def test_raising_b_lets_the_queue_grow():
    b = make_batcher(EncodeSpec(batch_bound=2, max_age_ms=1000))
    _fill(b, 2)
    reconfigure_batcher(b, EncodeSpec(batch_bound=5, max_age_ms=1000))
    assert b.poll(0.0015) is None or b.pending == 0  # gap may fire; FULL no longer does at 2
    b2 = make_batcher(EncodeSpec(batch_bound=2, max_age_ms=1000, dispatch="fixed-timeout", timeout_ms=1000))
    _fill(b2, 2)
    reconfigure_batcher(b2, EncodeSpec(batch_bound=5, dispatch="fixed-timeout", timeout_ms=1000))
    assert b2.poll(0.002) is None and b2.pending == 2
    _fill(b2, 3, t0=0.003)
    d = b2.poll(0.006)
    assert d is not None and d.reason == DispatchReason.FULL and d.items == (0, 1, 0, 1, 2)


def test_params_change_in_place():
    b = make_batcher(EncodeSpec(batch_bound=4, max_age_ms=100, gap_quantile=0.5, rate_half_life_ms=1000))
    assert isinstance(b, PoissonGapBatcher)
    _fill(b, 3, dt=0.01)
    rate = b.rate_estimate
    reconfigure_batcher(b, EncodeSpec(batch_bound=4, max_age_ms=20, gap_quantile=0.9, rate_half_life_ms=500))
    assert b.max_age_s == pytest.approx(0.02) and b.gap_quantile == pytest.approx(0.9)
    assert b.rate_estimate == pytest.approx(rate)  # λ̂ keeps its history
    assert b.next_wakeup(0.02) <= 0.02  # the new valve (oldest at 0 + 20 ms) applies at once
    t = make_batcher(EncodeSpec(batch_bound=4, dispatch="fixed-timeout", timeout_ms=100))
    reconfigure_batcher(t, EncodeSpec(batch_bound=4, dispatch="fixed-timeout", timeout_ms=10))
    assert isinstance(t, FixedTimeoutBatcher) and t.timeout_s == pytest.approx(0.01)


@pytest.mark.parametrize("to", ["eager", "fixed-timeout", "poisson-gap"])
def test_policy_switch_keeps_pending_and_rate(to):
    b = make_batcher(EncodeSpec(batch_bound=16, max_age_ms=1000))
    _fill(b, 5, dt=0.01)
    rate = b.rate_estimate
    nb = reconfigure_batcher(b, EncodeSpec(batch_bound=3, dispatch=to, timeout_ms=5, max_age_ms=1000))
    assert nb.pending == 5 and nb.batch_bound == 3
    assert nb.rate_estimate == pytest.approx(rate)
    got = []
    now = 0.05
    while nb.pending:
        d = nb.poll(now)
        if d is None:
            now = nb.next_wakeup(now)
            continue
        got.extend(d.items)
        assert len(d.items) <= 3
    assert got == [0, 1, 2, 3, 4]
    if to == "eager":
        assert isinstance(nb, EagerBatcher)


def test_reconfigure_rejects_a_foreign_object():
    with pytest.raises(TypeError):
        reconfigure_batcher(object(), EncodeSpec())  # type: ignore[arg-type]
