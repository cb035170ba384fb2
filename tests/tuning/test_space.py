"""The shared space and turning a point into a spec."""

from __future__ import annotations

import pytest
from easerve_operator.tuning.space import (
    Alloc,
    Candidate,
    SearchSpace,
    apply_candidate,
    enumerate_allocations,
    s_grid,
    snap_s,
    space_for,
)
from easerve_runtime.api import parse_spec, spec_errors
from pydantic import ValidationError


def test_grid_helpers():
    assert s_grid(0.1) == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert s_grid(0.25, 0.3, 1.0) == (0.5, 0.75, 1.0)
    assert snap_s(0.625, 0.1) == 0.6 and snap_s(1.3, 0.1) == 1.0
    with pytest.raises(ValueError, match="s_step"):
        s_grid(0.0)


def test_space_size_and_points(image_spec):
    space = space_for(image_spec, 2, max_batch=4, s_step=0.5)
    # 5 allocations with a remote prefill pool (3 s values each) and 4 all-local ones (s = 0 only)
    assert space.size == 5 * 4 * 3 + 4 * 4 * 1 == len(list(space.points()))
    all_local = [a for a in space.allocations if a.prefill == 0]
    assert {a.label for a in all_local} == {
        "6E-0P(tp2)-1D(tp2)",
        "4E-0P(tp2)-2D(tp2)",
        "2E-0P(tp2)-3D(tp2)",
        "4E-0P(tp2)-1D(tp4)",
    }
    assert all(space.s_values(a) == (0.0,) for a in all_local)
    assert space_for(image_spec, 2, local_prefill=False).s_values() == (1.0,)
    with pytest.raises(ValueError, match="gpuBudget"):
        space_for(image_spec.model_copy(update={"gpu_budget": 4}), 4)


def test_apply_candidate_copies_the_spec(image_spec):
    c = Candidate(Alloc(4, 1, 2, 1, 2), 3, 0.7)
    out = apply_candidate(image_spec, c)
    assert out.allocation.label() == "4E-1P(tp2)-1D(tp2)"
    assert out.encode.batch_bound == 3 and out.offload.ratio == 0.7
    assert out.sm_partition.mode == "dynamic"
    # everything else is the user's
    assert out.slo == image_spec.slo and out.encode.dispatch == image_spec.encode.dispatch
    assert image_spec.encode.batch_bound == 8  # the input is untouched
    # s = 1: no local prefill, so no SM partition
    assert apply_candidate(image_spec, Candidate(Alloc(4, 1, 2, 1, 2), 3, 1.0)).sm_partition.mode == "none"


def test_apply_candidate_rejects_an_impossible_point(image_spec):
    with pytest.raises(ValueError, match="gpuBudget"):
        apply_candidate(image_spec, Candidate(Alloc(4, 2, 2, 2, 2), 1, 1.0))


def test_space_rejects_empty():
    with pytest.raises(ValueError, match="no feasible allocation"):
        SearchSpace(())


def two_gpus(spec):
    """``spec`` on a 2-GPU budget whose backbone fits one GPU (the h200 profile: min_tp 1)."""
    return spec.model_copy(
        update={"gpu_budget": 2, "engine": spec.engine.model_copy(update={"profile": "llava-v1.6-34b@h200"})}
    )


def test_two_gpus_hold_only_the_all_local_layout_at_s_zero(image_spec):
    space = space_for(two_gpus(image_spec), 1, max_batch=4, s_step=0.1)
    assert space.allocations == (Alloc(1, 0, 1, 1, 1),) and space.allocations[0].label == "1E-0P-1D"
    points = list(space.points())
    assert [(c.batch_bound, c.offload_ratio) for c in points] == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]
    assert not space.contains(Candidate(Alloc(1, 0, 1, 1, 1), 2, 0.1))
    # the point is a valid spec: no remote prefill pool, local prefill under a partition
    out = apply_candidate(two_gpus(image_spec), points[1])
    assert out.allocation.prefill.replicas == 0 and out.offload.ratio == 0.0 and out.has_local_prefill
    assert out.sm_partition.mode == "dynamic" and out.allocation.gpus == 2


def test_an_engine_without_tensor_parallelism_gets_a_space_without_it(image_spec):
    """``tp_options=(1,)`` (the torch engine): three GPUs then hold no TP-2 decode pool."""
    three = two_gpus(image_spec).model_copy(update={"gpu_budget": 3})
    assert "1E-0P-1D(tp2)" in {a.label for a in space_for(three, 1).allocations}
    labels = {a.label for a in space_for(three, 1, tp_options=(1,)).allocations}
    assert labels == {"1E-1P-1D", "2E-0P-1D", "1E-0P-2D"}


def test_without_local_prefill_two_gpus_fit_nothing_and_the_error_says_why(image_spec):
    with pytest.raises(ValueError, match=r"spec.gpuBudget=2: .*3 GPUs.*local prefill is off"):
        space_for(two_gpus(image_spec), 1, local_prefill=False)
    assert enumerate_allocations(2, 1) == []  # no local prefill: one worker per stage


def test_all_local_layouts_need_whole_local_prefill_pods():
    # backbone at TP 2: a local prefill worker spans 2 encode GPUs, so 5 GPUs give 2E-0P-1D(tp2)
    # (the fifth GPU cannot be an encode worker without a local prefill partner)
    allocs = enumerate_allocations(5, 2, local_prefill=True, local_tp=2)
    assert [a.label for a in allocs if a.prefill == 0] == ["2E-0P(tp2)-1D(tp2)"]
    assert all(a.encode % 2 == 0 for a in enumerate_allocations(8, 2, local_prefill=True, local_tp=2, full_only=False)
               if a.prefill == 0)
    assert enumerate_allocations(3, 2, local_prefill=True, local_tp=2) == []
    with pytest.raises(ValueError, match="no prefill worker at all"):
        SearchSpace((Alloc(3, 0, 2, 1, 2),), local_tp=2)


def test_nearest_s_keeps_s_where_the_allocation_allows_it(image_spec):
    space = space_for(image_spec, 2, s_step=0.1)
    remote, all_local = Alloc(4, 1, 2, 1, 2), Alloc(6, 0, 2, 1, 2)
    assert space.nearest_s(remote, 0.3) == 0.3 and space.nearest_s(all_local, 0.3) == 0.0
    no_local = space_for(image_spec, 2, local_prefill=False)
    assert no_local.nearest_s(remote, 0.3) == 1.0


def test_prefill_zero_with_s_above_zero_is_refused_naming_the_field(image_spec):
    c = Candidate(Alloc(1, 0, 1, 1, 1), 2, 0.3)
    with pytest.raises(ValueError, match="spec.offload.ratio"):
        apply_candidate(two_gpus(image_spec), c)
    raw = two_gpus(image_spec).wire()
    raw["allocation"] = {"encode": {"replicas": 1}, "prefill": {"replicas": 0}, "decode": {"replicas": 1}}
    raw["offload"] = {"ratio": 0.0}
    assert parse_spec(raw).allocation.label() == "1E-0P-1D"  # s = 0: every prefill runs locally
    for s in (0.3, 1.0):
        raw["offload"] = {"ratio": s}
        raw["smPartition"] = {"mode": "none"}
        with pytest.raises(ValidationError) as info:
            parse_spec(raw)
        lines = spec_errors(info.value)
        assert any(line.startswith("spec.offload.ratio") and "prefill.replicas is 0" in line for line in lines), lines
