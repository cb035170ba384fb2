"""Property tests of the queue view over random queues (hypothesis)."""

from __future__ import annotations

from easerve_runtime.policies.omni import FCFSScheduler, OmniRequest, OmniScheduler, PathKind
from hypothesis import given, settings
from hypothesis import strategies as st

req_st = st.builds(
    lambda i, long, dl, rem, dec: OmniRequest(
        f"r{i}",
        "audio" if long else "text",
        PathKind.LONG if long else PathKind.SHORT,
        0.0,
        dl,
        rem,
        100,
        dec,
    ),
    st.integers(0, 10**6),
    st.booleans(),
    st.floats(0.0, 10.0),
    st.floats(0.001, 5.0),
    st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(req_st, max_size=40), st.integers(0, 50), st.integers(1, 6), st.floats(0.0, 5.0))
def test_view_invariants(queue: list[OmniRequest], k: int, cap: int, now: float) -> None:
    w = OmniScheduler(FCFSScheduler(), long_path_cap=cap)
    before = list(queue)
    w.annotate(queue, now)
    w.adapt_n(queue)
    phase = w.phase(k)
    view, hidden = w.view(queue, phase)
    assert all(a is b for a, b in zip(queue, before, strict=True))  # the queue itself is untouched
    assert hidden == len(queue) - len(view)
    ids = {id(r) for r in view}
    assert [r for r in queue if id(r) in ids] == view  # original order kept
    for r in queue:
        if r.in_decode or r.protected:
            assert id(r) in ids  # never hidden
    ordinary_long = [r for r in queue if r.path is PathKind.LONG and not r.in_decode and not r.protected]
    visible_ol = [r for r in ordinary_long if id(r) in ids]
    assert len(visible_ol) <= cap
    if visible_ol:  # the cap keeps the earliest deadlines
        assert max(r.deadline for r in visible_ol) <= min(
            (r.deadline for r in ordinary_long if id(r) not in ids), default=float("inf")
        )
    has_phase_work = any(r.path is phase and not r.in_decode for r in queue)
    for r in queue:  # only ordinary prefills of the other path, or capped long ones, are hidden
        if id(r) not in ids:
            assert not r.in_decode and not r.protected
            assert (has_phase_work and r.path is not phase) or r.path is PathKind.LONG
    # N stays in range and M = 2
    assert w.n_min <= w.n <= w.n_max and w.m == 2
