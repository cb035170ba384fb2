"""Deficit router and least-outstanding picker properties."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from easerve_runtime.policies.router import DeficitRouter, LeastOutstanding, Route, least_outstanding
from hypothesis import given, settings
from hypothesis import strategies as st

ratios = st.one_of(
    st.floats(min_value=0.0, max_value=1.0, allow_nan=False),
    st.sampled_from([0.0, 1.0, 0.1, 0.2, 0.3, 1 / 3, 0.5, 0.55, 2 / 3, 0.7, 0.9, 0.99, 1e-9, 1 - 1e-9]),
)


def _runs(seq: list[Route], route: Route) -> int:
    best = cur = 0
    for r in seq:
        cur = cur + 1 if r == route else 0
        best = max(best, cur)
    return best


@settings(max_examples=300, deadline=None)
@given(s=ratios, n=st.integers(min_value=0, max_value=3000))
def test_deficit_split_is_even(s, n):
    r = DeficitRouter(s)
    seq = [r.decide() for _ in range(n)]
    remote = seq.count(Route.REMOTE)
    assert abs(remote - n * s) <= 1
    assert remote == r.remote_count and n - remote == r.local_count
    assert 0.0 <= r.deficit < 1.0
    if s < 1.0:
        assert _runs(seq, Route.REMOTE) <= math.ceil(1.0 / (1.0 - s))
    else:
        assert remote == n  # s = 1 is always remote
    if s > 0.0:
        if 1.0 / s < math.inf:  # (a subnormal s has an unbounded local run)
            assert _runs(seq, Route.LOCAL) <= math.ceil(1.0 / s)
    else:
        assert remote == 0  # s = 0 is always local
    # exact: after n decisions floor(n*s) went remote (s as the exact rational the float is)
    assert remote == math.floor(n * Fraction(s))


def test_float_pitfall_point_one():
    r = DeficitRouter(0.1)
    seq = [r.decide() for _ in range(10)]
    assert seq == [Route.LOCAL] * 9 + [Route.REMOTE] or seq.count(Route.REMOTE) == 1
    r2 = DeficitRouter(0.1)
    assert _runs([r2.decide() for _ in range(1000)], Route.LOCAL) <= 10


def test_half_alternates_starting_local():
    r = DeficitRouter(0.5)
    assert [r.decide() for _ in range(4)] == [Route.LOCAL, Route.REMOTE, Route.LOCAL, Route.REMOTE]


@settings(max_examples=100, deadline=None)
@given(s1=ratios, s2=ratios, n1=st.integers(0, 200), n2=st.integers(0, 200))
def test_retuning_keeps_deficit_in_range(s1, s2, n1, n2):
    r = DeficitRouter(s1)
    for _ in range(n1):
        r.decide()
    r.set_ratio(s2)
    seq = [r.decide() for _ in range(n2)]
    assert 0.0 <= r.deficit < 1.0
    assert abs(seq.count(Route.REMOTE) - n2 * s2) <= 1


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True])
def test_bad_ratio(bad):
    with pytest.raises(ValueError, match="ratio"):
        DeficitRouter(bad)


def test_least_outstanding_min_and_rotation():
    assert least_outstanding(["a", "b", "c"], {"a": 2, "b": 1, "c": 3}) == "b"
    assert least_outstanding(["a", "b"], {}) == "a"
    assert least_outstanding(["a", "b", "c"], {"a": 0, "b": 5, "c": 0}, start=1) == "c"
    with pytest.raises(ValueError, match="no candidates"):
        least_outstanding([], {})
    # ties rotate instead of restarting at the first candidate
    p = LeastOutstanding()
    picks = [p.pick(["w0", "w1", "w2"], {}) for _ in range(6)]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


@settings(max_examples=100, deadline=None)
@given(
    k=st.integers(1, 6),
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 5)), min_size=1, max_size=200),
)
def test_least_outstanding_picks_a_minimum_and_balances(k, events):
    cands = [f"w{i}" for i in range(k)]
    out = dict.fromkeys(cands, 0)
    p = LeastOutstanding()
    for is_pick, j in events:
        if is_pick:
            w = p.pick(cands, out)
            assert out[w] == min(out.values())
            out[w] += 1
        else:
            w = cands[j % k]
            if out[w]:
                out[w] -= 1
    # with picks only, load stays within 1 across workers
    out2 = dict.fromkeys(cands, 0)
    for _ in range(len(events)):
        out2[p.pick(cands, out2)] += 1
    assert max(out2.values()) - min(out2.values()) <= 1


def test_pickers_that_see_only_their_own_counts_burst_in_lockstep_unless_their_rotations_start_apart():
    """One frontend per encode pod, each counting only its own requests: six frontends starting their
    rotation at 0 send the first six requests (dealt one per frontend) all to the first encoder; each
    process's own start spreads them."""
    from easerve_runtime.policies.router import process_rotation_start

    encoders = [f"e{i}" for i in range(6)]

    def first_round(starts: list[int]) -> list[str]:
        pickers = [LeastOutstanding(s) for s in starts]
        return [p.pick(encoders, {}) for p in pickers]  # each frontend's own counts: all zero

    assert first_round([0] * 6) == ["e0"] * 6
    assert sorted(first_round(list(range(6)))) == encoders
    starts = [process_rotation_start(f"encode-pod-{i}:{1000 + i}") for i in range(6)]
    assert len(set(starts)) == 6 and starts == [process_rotation_start(f"encode-pod-{i}:{1000 + i}") for i in range(6)]
    assert len(set(first_round(starts))) > 1
    with pytest.raises(ValueError, match="start"):
        LeastOutstanding(-1)


def test_the_twins_frontends_start_apart_where_hashed_fixed_names_ran_them_in_step():
    """Three frontends over six encoders (the all-local trial's one frontend per encode pod): the
    twin used to hash "frontend-0".."frontend-2", which all land on start 4 mod 6, so its three
    frontends picked in lockstep. The even spread sends their first requests to three encoders of
    three different pods (two encoders a pod, pods in order)."""
    import zlib

    from easerve_runtime.policies.router import spread_rotation_starts

    encoders = [f"e{i}" for i in range(6)]
    hashed = [(zlib.crc32(f"frontend-{i}".encode()) & 0xFFFF) % 6 for i in range(3)]
    assert len(set(hashed)) == 1  # the old rule's lockstep, for the record
    starts = spread_rotation_starts(6, 3)
    assert starts == [0, 2, 4]
    firsts = [LeastOutstanding(s).pick(encoders, {}) for s in starts]
    assert len({int(e[1:]) // 2 for e in firsts}) == 3  # one per pod
    assert spread_rotation_starts(2, 1) == [0] and spread_rotation_starts(4, 2) == [0, 2]
    assert len(set(spread_rotation_starts(5, 5))) == 5
    with pytest.raises(ValueError, match="pickers"):
        spread_rotation_starts(6, 0)
