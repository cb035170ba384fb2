"""The aggregated iteration planner (``policies.aggregated``), the object the twin's aggregated
baseline and the live aggregated worker share."""

from __future__ import annotations

import pytest
from easerve_runtime.policies.aggregated import AggregatedPlanner


def chunks(it):
    return [(c.item, c.start, c.tokens, c.first, c.last) for c in it.chunks]


def test_chunked_prefill_fills_the_budget_less_the_decode_tokens() -> None:
    p: AggregatedPlanner[str] = AggregatedPlanner(100, 8, 1e9)
    p.add("a", 150, 1.0)
    p.add("b", 30, 1.0)
    it = p.plan()
    assert chunks(it) == [("a", 0, 100, True, False)] and it.tokens == 100 and it.decodes == 0
    it = p.plan()  # a's rest, then b in what is left
    assert chunks(it) == [("a", 100, 50, False, True), ("b", 0, 30, True, True)]
    p.prefilled(1.0, True)
    p.prefilled(1.0, True)
    p.add("c", 200, 1.0)
    it = p.plan()  # two decode tokens come out of the budget
    assert it.decodes == 2 and chunks(it) == [("c", 0, 98, True, False)]


def test_whole_prompts_fit_or_run_alone() -> None:
    p: AggregatedPlanner[str] = AggregatedPlanner(100, 8, 1e9, chunked=False)
    for name, n in (("a", 40), ("b", 50), ("c", 30), ("d", 500)):
        p.add(name, n, 1.0)
    assert chunks(p.plan()) == [("a", 0, 40, True, True), ("b", 0, 50, True, True)]
    assert chunks(p.plan()) == [("c", 0, 30, True, True)]  # d does not fit next to c
    assert chunks(p.plan()) == [("d", 0, 500, True, True)]  # longer than the budget: alone
    assert p.prefilling == 4 and not len(p)


def test_admission_waits_for_kv_memory_and_the_sequence_cap() -> None:
    p: AggregatedPlanner[str] = AggregatedPlanner(1000, 2, 10.0)
    p.add("a", 10, 6.0)
    p.add("b", 10, 6.0)
    assert [c.item for c in p.plan().chunks] == ["a"]  # b's KV would not fit next to a's
    p.prefilled(6.0, True)
    assert p.plan().chunks == []  # a decodes; b still waits
    p.finish(6.0)
    assert [c.item for c in p.plan().chunks] == ["b"]
    p.prefilled(6.0, True)
    p.add("c", 10, 1.0)
    p.add("d", 10, 1.0)
    assert [c.item for c in p.plan().chunks] == ["c"]  # cap 2: b running + c prefilling
    # a lone request always runs, even one larger than the whole capacity
    q: AggregatedPlanner[str] = AggregatedPlanner(1000, 2, 10.0)
    q.add("huge", 10, 50.0)
    assert [c.item for c in q.plan().chunks] == ["huge"]


def test_drop_and_resize() -> None:
    p: AggregatedPlanner[str] = AggregatedPlanner(100, 8, 10.0)
    p.add("a", 250, 4.0)
    p.add("b", 10, 4.0)
    p.plan()
    assert p.prefilling == 1 and p.reserved == 4.0
    p.resize("a", 180)  # the processor's count: 100 done, 80 left
    assert chunks(p.plan()) == [("a", 100, 80, False, True), ("b", 0, 10, True, True)]
    p.add("c", 10, 4.0)
    assert p.drop("c") and not p.drop("c")
    assert p.drop("b") is False  # already planned whole: the driver releases it itself
    with pytest.raises(ValueError):
        AggregatedPlanner(0, 1, 1.0)
