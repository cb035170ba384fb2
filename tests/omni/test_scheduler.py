"""The HorizonServe queue-view wrapper: rotation, adaptation of N, protection, cap, restore."""

from __future__ import annotations

import json

import pytest
from easerve_runtime.api import OmniClass, OmniSpec
from easerve_runtime.policies.omni import (
    EDFScheduler,
    FCFSScheduler,
    OmniRequest,
    OmniScheduler,
    PathKind,
    SLOTable,
    class_for_priority,
    class_table,
    remove_picked,
)

S, L = PathKind.SHORT, PathKind.LONG


def req(
    i: int,
    path: PathKind,
    arrival: float = 0.0,
    deadline: float = 100.0,
    remaining: float = 0.01,
    decode: bool = False,
    tokens: int = 10,
) -> OmniRequest:
    return OmniRequest(
        f"r{i}", "text" if path is S else "audio", path, arrival, deadline, remaining, tokens, decode
    )


class Everything(FCFSScheduler):
    """A base that picks the whole view, so tests see exactly what the wrapper exposed."""

    def pick(self, view, now):  # type: ignore[no-untyped-def]
        return list(view)


def wrapper(**kw) -> OmniScheduler:  # type: ignore[no-untyped-def]
    return OmniScheduler(kw.pop("base", Everything()), **kw)


def test_rotation_phase_sequence_follows_k_mod_n_plus_m() -> None:
    w = wrapper(n_min=3, n_max=3, rotation_m=2)
    q = [req(0, S), req(1, L)]
    phases = [w.schedule(q, 0.0).phase for _ in range(10)]
    assert phases == [S, S, S, L, L, S, S, S, L, L]


def test_n_adapts_linearly_to_protected_short_fraction() -> None:
    w = wrapper(n_min=2, n_max=8, u_guard=1.5)
    now = 10.0
    # 4 waiting short-path requests; deadline - now = 1 s; remaining 1 s -> u = 1 < 1.5 -> protected
    tight = [req(i, S, deadline=now + 1.0, remaining=1.0) for i in range(2)]
    loose = [req(10 + i, S, deadline=now + 100.0, remaining=1.0) for i in range(2)]
    decoding_tight = req(20, S, deadline=now, remaining=1.0, decode=True)  # not waiting: not counted
    w.annotate(tight + loose + [decoding_tight], now)
    assert w.adapt_n(tight + loose + [decoding_tight]) == 5  # 2 + 0.5 * 6
    w.annotate(tight, now)
    assert w.adapt_n(tight) == 8
    w.annotate(loose, now)
    assert w.adapt_n(loose) == 2
    assert w.adapt_n([]) == 2
    # and the cycle length follows N: with N = 8 the long phase comes at k = 8, 9
    w.annotate(tight, now)
    w.adapt_n(tight)
    assert [w.phase(k) for k in range(10)] == [S] * 8 + [L, L]


def test_protected_requests_are_never_hidden() -> None:
    w = wrapper(n_min=2, n_max=2, long_path_cap=1)
    now = 0.0
    protected_long = [req(i, L, deadline=0.1, remaining=1.0) for i in range(3)]  # u = 0.1 < guard
    ordinary_long = [req(10 + i, L, deadline=100.0) for i in range(3)]
    shorts = [req(20, S, deadline=0.05, remaining=1.0), req(21, S)]
    q = shorts + protected_long + ordinary_long
    for _ in range(8):  # both phases, cap of 1
        plan = w.schedule(q, now)
        visible = {r.id for r in plan.batch}
        assert all(r.id in visible for r in protected_long), plan.phase
        assert "r20" in visible  # a protected short request survives the long phase too


def test_decode_continuations_are_never_hidden() -> None:
    w = wrapper(n_min=2, n_max=2, long_path_cap=1)
    dec = [req(i, L, decode=True) for i in range(5)] + [req(10 + i, S, decode=True) for i in range(5)]
    q = dec + [req(20, S), req(21, L), req(22, L)]
    for _ in range(8):
        plan = w.schedule(q, 0.0)
        assert all(any(b is d for b in plan.batch) for d in dec)


def test_short_phase_hides_ordinary_long_prefills_and_long_phase_hides_short() -> None:
    w = wrapper(n_min=2, n_max=2, rotation_m=2)
    s, lg = req(0, S), req(1, L)
    plans = [w.schedule([s, lg], 0.0) for _ in range(4)]
    assert [p.batch for p in plans] == [[s], [s], [lg], [lg]]
    assert all(p.hidden == 1 for p in plans)


def test_rotation_is_work_conserving() -> None:
    w = wrapper(n_min=2, n_max=2)
    only_long = [req(1, L), req(2, L)]
    assert w.schedule(only_long, 0.0).batch == only_long  # short phase, but no short work waiting


def test_long_path_cap_keeps_earliest_deadlines() -> None:
    w = wrapper(n_min=1, n_max=1, rotation_m=1, long_path_cap=2)
    longs = [req(i, L, deadline=d) for i, d in enumerate([50.0, 10.0, 40.0, 20.0, 30.0])]
    w.k = 1  # a long phase
    plan = w.schedule(longs, 0.0)
    assert plan.phase is L
    assert [r.deadline for r in plan.batch] == [10.0, 20.0]  # queue order kept, earliest deadlines chosen
    assert plan.hidden == 3
    # the EDF base then orders them by deadline as well
    w2 = OmniScheduler(EDFScheduler(), n_min=1, n_max=1, rotation_m=1, long_path_cap=3)
    w2.k = 1
    assert [r.deadline for r in w2.schedule(longs, 0.0).batch] == [10.0, 20.0, 30.0]


def test_restore_leaves_queue_unchanged_apart_from_picked_batch() -> None:
    base = FCFSScheduler(max_prefills=2)
    w = OmniScheduler(base, n_min=2, n_max=2, long_path_cap=1)
    q = [req(0, L), req(1, S), req(2, L, decode=True), req(3, L), req(4, S), req(5, S), req(6, L)]
    before = list(q)
    plan = w.schedule(q, 0.0)
    assert q == before and all(a is b for a, b in zip(q, before, strict=True))  # nothing moved or lost
    assert plan.hidden > 0
    prefills = [r for r in plan.batch if not r.in_decode]
    remove_picked(q, prefills)
    assert q == [r for r in before if not any(r is p for p in prefills)]


def test_fcfs_respects_token_budget_but_always_admits_one() -> None:
    base = FCFSScheduler(max_prefill_tokens=100)
    big = req(0, S, tokens=500)
    assert base.pick([big, req(1, S, tokens=10)], 0.0) == [big]


def test_slo_table_round_trips_through_json_and_follows_spec() -> None:
    spec = OmniSpec(
        classes=[
            OmniClass(name="text", output="text", slo_multiplier=5),
            OmniClass(name="audio", output="audio", slo_multiplier=3),
            OmniClass(name="image", output="image", slo_seconds=20.0),
        ]
    )
    t = SLOTable.from_spec(spec, {"text": 0.03, "audio": 1.2})
    assert t.seconds("text") == pytest.approx(0.15)
    assert t.seconds("audio") == pytest.approx(3.6)
    assert t.seconds("image") == 20.0
    back = SLOTable.from_json(t.to_json())
    assert back == t and back.as_dict() == t.as_dict()
    assert json.loads(t.to_json())["sloSeconds"]["audio"] == pytest.approx(3.6)
    with pytest.raises(ValueError, match="no sloSeconds"):
        SLOTable.from_spec(spec, {"text": 0.03})
    with pytest.raises(ValueError, match="missing field"):
        SLOTable.from_json("{}")


def test_classes_from_api_priority() -> None:
    spec = OmniSpec(
        classes=[
            OmniClass(name="t", output="text"),
            OmniClass(name="a", output="audio"),
            OmniClass(name="i", output="image"),
        ]
    )
    table = class_table(spec.classes)
    assert [class_for_priority(table, p).name for p in (0, 10, 20)] == ["t", "a", "i"]
    assert table["t"].path is S and table["a"].path is L and table["i"].path is L
    with pytest.raises(ValueError, match="priority"):
        class_for_priority(table, 5)
