"""Every feasible (E, P, D) allocation for a GPU budget, for the baselines' sweeps.

Encode workers use one GPU each; prefill and decode TP comes from {1, 2, 4, 8} wherever the
backbone fits (weights plus room for KV, from the profile's memory figures). We keep allocations
that use the whole budget, or all but one GPU when TP granularity makes the whole budget
impossible; an allocation that leaves more GPUs idle is dominated by one that gives them work.

This enumeration lives in the runtime because the twin's baselines need it and the runtime may
not import the operator; HAS (``easerve_operator.tuning.space``) has its own search space and
may use this one to cross-check.
"""

from __future__ import annotations

from easerve_runtime.api import Allocation, StageAllocation
from easerve_runtime.sim.latency import StageModel

TP_OPTIONS = (1, 2, 4, 8)


def feasible_tps(model: StageModel) -> tuple[int, ...]:
    return tuple(tp for tp in TP_OPTIONS if model.fits(tp))


def feasible_allocations(budget: int, model: StageModel, slack: int = 1) -> list[Allocation]:
    """Allocations using between ``budget - slack`` and ``budget`` GPUs (one of each stage at least)."""
    tps = feasible_tps(model)
    if not tps:
        raise ValueError("spec.engine.profile: the backbone fits no TP degree in {1, 2, 4, 8} on this GPU")
    out: list[Allocation] = []
    for n_e in range(1, budget + 1):
        for tp_p in tps:
            for n_p in range(1, (budget - n_e) // tp_p + 1):
                rest = budget - n_e - n_p * tp_p
                for tp_d in tps:
                    for n_d in range(1, rest // tp_d + 1):
                        used = n_e + n_p * tp_p + n_d * tp_d
                        if used < budget - slack:
                            continue
                        out.append(
                            Allocation(
                                encode=StageAllocation(replicas=n_e, tensor_parallel=1),
                                prefill=StageAllocation(replicas=n_p, tensor_parallel=tp_p),
                                decode=StageAllocation(replicas=n_d, tensor_parallel=tp_d),
                            )
                        )
    if not out:
        raise ValueError(
            f"spec.gpuBudget: {budget} GPUs cannot host an encode, a prefill and a decode worker"
        )
    return out


def aggregated_layouts(budget: int, model: StageModel) -> list[tuple[int, int]]:
    """(tp, replicas) layouts that fill the budget with aggregated engines."""
    out = [(tp, budget // tp) for tp in feasible_tps(model) if budget // tp >= 1]
    if not out:
        raise ValueError(f"spec.gpuBudget: {budget} GPUs cannot host one aggregated replica")
    return out
