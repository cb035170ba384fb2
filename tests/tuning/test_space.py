"""The shared space and turning a point into a spec."""

from __future__ import annotations

import pytest
from easerve_operator.tuning.space import (
    Alloc,
    Candidate,
    SearchSpace,
    apply_candidate,
    s_grid,
    snap_s,
    space_for,
)


def test_grid_helpers():
    assert s_grid(0.1) == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert s_grid(0.25, 0.3, 1.0) == (0.5, 0.75, 1.0)
    assert snap_s(0.625, 0.1) == 0.6 and snap_s(1.3, 0.1) == 1.0
    with pytest.raises(ValueError, match="s_step"):
        s_grid(0.0)


def test_space_size_and_points(image_spec):
    space = space_for(image_spec, 2, max_batch=4, s_step=0.5)
    assert space.size == 5 * 4 * 3 == len(list(space.points()))
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
