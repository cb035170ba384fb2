"""Stage 1 on hand-computed cases: C_E doubling, scores, pruning, B_max and s*."""

from __future__ import annotations

import pytest
from easerve_operator.tuning.space import Alloc, SearchSpace, enumerate_allocations
from easerve_operator.tuning.stage1 import (
    StageCapacities,
    b_max,
    decide,
    profile_encode,
    run_stage1,
    s_star,
    score_allocations,
    seed_range,
)

A = Alloc(2, 1, 2, 1, 4)  # 2E-1P(tp2)-1D(tp4)
B = Alloc(2, 1, 2, 2, 2)  # 2E-1P(tp2)-2D(tp2)
C = Alloc(2, 1, 4, 1, 2)  # 2E-1P(tp4)-1D(tp2)
D = Alloc(2, 2, 2, 1, 2)  # 2E-2P(tp2)-1D(tp2)
E = Alloc(4, 1, 2, 1, 2)  # 4E-1P(tp2)-1D(tp2)


def caps(alpha: float = 0.3) -> StageCapacities:
    return StageCapacities(
        c_e=2.7,
        b_sat=4,
        encode_curve=((1, 1.0), (2, 1.8), (4, 2.6), (8, 2.7)),
        c_p={2: 1.5, 4: 2.5},
        c_d={2: 1.9, 4: 3.5},
        alpha=alpha,
        alpha_source="test",
    )


def test_encode_doubling_stops_below_five_percent_gain():
    table = {1: 1.0, 2: 1.8, 4: 2.6, 8: 2.7, 16: 2.72}
    asked: list[int] = []

    def probe(b: int) -> tuple[float, float]:
        asked.append(b)
        return table[b], 1.0

    c_e, b_sat, curve, cost = profile_encode(probe)
    # 1->2: +80%, 2->4: +44%, 4->8: +3.8% < 5% -> stop; 16 is never measured
    assert asked == [1, 2, 4, 8]
    assert (c_e, b_sat, cost) == (2.7, 4, 4.0)
    assert curve == ((1, 1.0), (2, 1.8), (4, 2.6), (8, 2.7))


def test_encode_doubling_respects_max_batch():
    c_e, b_sat, curve, _ = profile_encode(lambda b: (float(b), 0.0), max_batch=8)
    assert [b for b, _ in curve] == [1, 2, 4, 8] and c_e == 8.0 and b_sat == 8


def test_enumeration_of_the_paper_setup():
    # 34B-class model needs TP >= 2 on a 48 GB GPU; 8 GPUs, whole budget used
    allocs = enumerate_allocations(8, 2)
    assert set(allocs) == {A, B, C, D, E}
    assert all(a.gpus == 8 for a in allocs)
    assert (
        len(enumerate_allocations(8, 2, full_only=False)) == 12
    )  # 4E variant also at 1..3 encoders, 2E at 1
    assert all(a.prefill_tp >= 4 and a.decode_tp >= 4 for a in enumerate_allocations(16, 4))


def test_scores_and_pruning_hand_computed():
    rows = score_allocations([E, D, C, B, A], caps(), 5.0)
    by = {r.alloc: r for r in rows}
    # A: Cap_E = 2*2.7 = 5.4, Cap_P = 1*1.5 + 2*0.3*1.5 = 2.4, Cap_D = 3.5 -> max rho = 5/2.4
    assert by[A].cap_e == pytest.approx(5.4)
    assert by[A].cap_p == pytest.approx(2.4)
    assert by[A].cap_d == pytest.approx(3.5)
    assert by[A].score == pytest.approx(5 / 2.4) and by[A].bottleneck == "P"
    # B: Cap_D = 2*1.9 = 3.8 -> still prefill-bound at 5/2.4
    assert by[B].score == pytest.approx(5 / 2.4) and by[B].cap_d == pytest.approx(3.8)
    # C, D, E: one decode worker at TP2 -> Cap_D = 1.9 -> rho_D = 2.63 > 1.2 * 2.083 = 2.5
    for x in (C, D, E):
        assert by[x].score == pytest.approx(5 / 1.9) and by[x].bottleneck == "D"
        assert not by[x].kept and "1.2x best" in by[x].reason
    assert by[C].cap_p == pytest.approx(2.5 + 2 * 0.3 * 2.5)
    assert by[D].cap_p == pytest.approx(3.0 + 0.9)
    assert by[E].cap_p == pytest.approx(1.5 + 4 * 0.45) and by[E].cap_e == pytest.approx(10.8)
    # order: best score first; equal scores by the remaining load ratios, largest first:
    # B's next-busiest stage is D at 5/3.8 = 1.32, A's is D at 5/3.5 = 1.43 -> B before A;
    # C, D, E (all D-bound at 5/1.9) next by rho_P: C 5/4.0 = 1.25 < D 5/3.9 = 1.28 < E 5/3.3 = 1.52
    assert [r.alloc for r in rows] == [B, A, C, D, E]
    assert [r.kept for r in rows] == [True, True, False, False, False]


def test_top_k_limits_survivors_and_says_why():
    rows = score_allocations([A, B, C, D, E], caps(), 5.0, top_k=1)
    assert [r.alloc for r in rows if r.kept] == [B]
    assert "beyond top K=1" in next(r for r in rows if r.alloc == A).reason


def test_without_local_prefill_cap_p_is_remote_only():
    rows = score_allocations([A], caps(), 5.0, local_prefill=False)
    assert rows[0].cap_p == pytest.approx(1.5) and rows[0].score == pytest.approx(5 / 1.5)


def test_all_local_allocation_takes_prefill_capacity_from_local_prefill_only():
    L = Alloc(6, 0, 2, 1, 2)  # 6E-0P(tp2)-1D(tp2): no remote prefill pool
    space = SearchSpace((L, A), s_step=0.1)
    rows = score_allocations([L], caps(), 1.0)
    # Cap_P = 0 * 1.5 + 6 local workers * 0.3 * 1.5 = 2.7; Cap_E = 6 * 2.7; Cap_D = 1.9
    assert rows[0].cap_p == pytest.approx(2.7) and rows[0].cap_e == pytest.approx(16.2)
    assert rows[0].cap_d == pytest.approx(1.9) and rows[0].score == pytest.approx(1 / 1.9)
    assert s_star(L, caps(), True) == 0.0
    r = seed_range(L, caps(), 1.0, space)  # s fixed at 0: no window around s* (the spec refuses s > 0)
    assert (r.s_star, r.s_lo, r.s_hi, r.s_seed) == (0.0, 0.0, 0.0, 0.0)
    # with local prefill off the space cannot hold it at all (nothing would prefill)
    with pytest.raises(ValueError, match="no prefill worker at all"):
        SearchSpace((L,), local_prefill=False)


def test_b_max_hand_computed():
    assert b_max(5.0, 2) == 3  # ceil(2.5)
    assert b_max(5.0, 4) == 2  # ceil(1.25)
    assert b_max(4.0, 2) == 2  # exact division stays
    assert b_max(2.0, 4) == 1  # never below 1


def test_s_star_and_window_hand_computed():
    space = SearchSpace((A, B, C, D, E), max_batch=16, s_step=0.1)
    # A: C_remote = 1.5, C_local = 2 * 0.3 * 1.5 = 0.9 -> s* = 0.625, window [0.425, 0.825]
    assert s_star(A, caps(), True) == pytest.approx(0.625)
    r = seed_range(A, caps(), 5.0, space)
    assert (r.b_max, r.b_seed) == (3, 3)  # min(B_max=3, B_sat=4)
    assert (r.s_lo, r.s_hi, r.s_seed) == (0.5, 0.8, 0.6)
    assert r.s_values(0.1) == (0.5, 0.6, 0.7, 0.8)
    # E: C_remote = 1.5, C_local = 4 * 0.45 = 1.8 -> s* = 0.4545, window [0.2545, 0.6545]
    r = seed_range(E, caps(), 5.0, space)
    assert r.s_star == pytest.approx(1.5 / 3.3, abs=1e-6)
    assert (r.s_lo, r.s_hi, r.s_seed) == (0.3, 0.6, 0.5)
    assert (r.b_max, r.b_seed) == (2, 2)
    # tiny alpha: s* = 1.5 / (1.5 + 0.15) = 0.909 -> window clipped at 1
    r = seed_range(A, caps(alpha=0.05), 5.0, space)
    assert (r.s_lo, r.s_hi, r.s_seed) == (0.8, 1.0, 0.9)
    # no local prefill: s is pinned to 1
    r = seed_range(A, caps(), 5.0, SearchSpace((A,), local_prefill=False))
    assert (r.s_lo, r.s_hi, r.s_seed) == (1.0, 1.0, 1.0)
    # B_max is clipped to the space's max_batch
    assert seed_range(A, caps(), 50.0, SearchSpace((A,), max_batch=8)).b_max == 8


def test_run_stage1_through_a_profiler(td):
    prof = td.TableTestProfiler(decode={2: 1.9, 4: 3.5})
    space = SearchSpace((A, B, C, D, E), s_step=0.1)
    res = run_stage1(prof, space, 5.0)
    assert res.capacities.c_e == 2.7 and res.capacities.b_sat == 4
    assert res.capacities.c_p == {2: 1.5, 4: 2.5} and res.capacities.c_d == {2: 1.9, 4: 3.5}
    assert res.capacities.alpha == 0.3 and res.capacities.alpha_source == "profile"
    # encode 4 probes x 10 s; prefill 2 TPs x 20 s; decode 2 TPs x 30 s; run concurrently -> max
    assert res.capacities.cost_s == {"encode": 40.0, "prefill": 40.0, "decode": 60.0}
    assert res.capacities.parallel_cost_s == 60.0
    assert res.survivors == (B, A)
    assert res.to_dict()["kept"] == 2 and res.to_dict()["of"] == 5
    # unknown alpha falls back to the documented default
    res2 = run_stage1(td.TableTestProfiler(decode={2: 1.9, 4: 3.5}, alpha=None), space, 5.0)
    assert res2.capacities.alpha_source == "default" and res2.capacities.alpha == 0.3


def test_decide_names_missing_capacity():
    with pytest.raises(ValueError, match="TP degrees"):
        decide(caps(), SearchSpace((Alloc(2, 1, 8, 1, 2),)), 5.0)


def test_stage1_round_trips_through_json():
    res = decide(caps(), SearchSpace((A, B, C, D, E)), 5.0)
    from easerve_operator.tuning.stage1 import Stage1Result

    back = Stage1Result.from_dict(res.to_dict())
    assert back.to_dict() == res.to_dict()


def test_local_workers_spanning_several_encode_gpus():
    # a TP2 backbone: one local prefill worker per two encode GPUs (n_L = floor(n_E / 2))
    rows = {r.alloc: r for r in score_allocations([A, E], caps(), 5.0, local_tp=2)}
    assert rows[A].cap_p == pytest.approx(1.5 + 1 * 0.3 * 1.5)  # n_L = 1
    assert rows[E].cap_p == pytest.approx(1.5 + 2 * 0.3 * 1.5)  # n_L = 2
    space = SearchSpace((A, Alloc(1, 1, 2, 1, 4)), max_batch=2, s_step=0.5, local_tp=2)
    lone = Alloc(1, 1, 2, 1, 4)
    assert space.s_values(lone) == (1.0,) and space.s_values(A) == (0.0, 0.5, 1.0)
    assert space.size == 2 * 3 + 2 * 1
    # the lone encode GPU cannot host a TP2 local worker: its s is pinned to 1
    r = seed_range(lone, caps(), 5.0, space)
    assert (r.s_lo, r.s_hi, r.s_seed) == (1.0, 1.0, 1.0)
    # A: s* = 1.5 / (1.5 + 0.45) = 0.769; the window [0.569, 0.969] holds no point of a 0.5 grid,
    # so the range collapses to the grid value nearest s*, 1.0
    assert s_star(A, caps(), True, local_tp=2) == pytest.approx(1.5 / 1.95)
    r = seed_range(A, caps(), 5.0, space)
    assert (r.s_lo, r.s_hi, r.s_seed) == (1.0, 1.0, 1.0)
    # decide() carries the space's local_tp into the scores
    res = decide(caps(), SearchSpace((A, E), local_tp=2), 5.0)
    assert {r.alloc: r.cap_p for r in res.rows} == pytest.approx({A: 1.95, E: 2.4})


def test_unsaturated_allocations_are_never_pruned():
    # Λ = 1: every allocation carries Λ (max ρ = 1/1.9 = 0.53 at worst), so all five survive
    # even with K = 1: below saturation the capacity score cannot rank them (latency decides).
    rows = score_allocations([A, B, C, D, E], caps(), 1.0, top_k=1)
    assert all(r.kept and "not saturated" in r.reason for r in rows)
    # Λ = 2: A and B (score 2/2.4 = 0.83) are unsaturated; C, D, E are D-bound at 2/1.9 = 1.05,
    # above saturation and above 1.2 x 0.83 = 1.0, so pruned by the old rule's factor.
    rows = score_allocations([A, B, C, D, E], caps(), 2.0, top_k=1)
    assert {r.alloc for r in rows if r.kept} == {A, B}
    assert all("1.2x best" in r.reason for r in rows if not r.kept)
    # saturation=0 restores the pure top-K rule
    rows = score_allocations([A, B, C, D, E], caps(), 1.0, top_k=1, saturation=0.0)
    assert [r.alloc for r in rows if r.kept] == [B]


def test_twin_image_at_rate_3_keeps_the_exhaustive_best():
    # The twin's Stage-1 capacities for llava-v1.6-34b at Λ = 3 (benchmarks/has_convergence.py).
    # The exhaustive best there is A = 2E-1P(tp2)-1D(tp4) (2.910 req/s; the other allocations
    # 2.843-2.851): its TP-4 decode shortens the drain. Its score 3/4.213 = 0.712 ranks it 4th
    # of 5, so the top-K rule alone pruned it.
    twin = StageCapacities(
        c_e=74.047,
        b_sat=2,
        encode_curve=((1, 62.009), (2, 71.268), (4, 74.047)),
        c_p={2: 2.14988, 4: 2.88506},
        c_d={2: 4.65069, 4: 16.53063},
        alpha=0.95954,
        alpha_source="profile",
    )
    rows = score_allocations([A, B, C, D, E], twin, 3.0, local_tp=2)
    assert [r.alloc for r in rows].index(A) == 3
    assert rows[3].score == pytest.approx(3 / (2.14988 + 0.95954 * 2.14988), rel=1e-6)
    assert all(r.kept for r in rows)
    old = score_allocations([A, B, C, D, E], twin, 3.0, local_tp=2, saturation=0.0)
    assert not next(r for r in old if r.alloc == A).kept
