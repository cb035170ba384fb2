"""The four systems compared in one run, on the same GPU budget and the same requests.

- ``easerve``: the configuration given (or tuned): the spec's allocation, batcher, B, s and SM
  partitioning.
- ``easerve-s1``: the same with s = 1 (no local prefill, so no SM partitioning).
- ``dynamo``: pass-through encode (B = 1, eager: each request is encoded alone as soon as the
  encoder is free), s = 1, no partitioning, per-request embedding transfer.
- ``aggregated``: vLLM-style engines that each run E+P+D (``sim/aggregated.py``).

``simulate_system`` runs ONE configuration of a system; ``best_of`` gives a baseline its best
configuration by sweeping (every feasible allocation for ``dynamo``, every TP layout for
``aggregated``), ranked by goodput at the spec's objective tier, then throughput, then mean TTFT.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.api import (
    Allocation,
    DispatchPolicy,
    EPDDeploymentSpec,
    PartitionMode,
)
from easerve_runtime.policies.batcher import EagerBatcher
from easerve_runtime.sim.aggregated import run_aggregated
from easerve_runtime.sim.allocations import aggregated_layouts, feasible_allocations
from easerve_runtime.sim.latency import StageModel
from easerve_runtime.sim.stages import DEFAULT_PREFILL_TOKEN_BUDGET
from easerve_runtime.sim.twin import run_pipeline
from easerve_runtime.workload.metrics import summarize
from easerve_runtime.workload.request import Request, RequestRecord

SYSTEMS = ("dynamo", "aggregated", "easerve-s1", "easerve")
AGGREGATED_TOKEN_BUDGETS = (2048, 8192)
"""Chunked-prefill token budgets the aggregated baseline is swept over (vLLM's two usual defaults)."""


@dataclass
class SimResult:
    """One simulated run: per-request records, the summary metrics, and where time went."""

    system: str
    config: dict[str, Any]
    records: list[RequestRecord]
    summary: dict[str, Any]
    utilisation: dict[str, float | None]
    dispatch_reasons: dict[str, int]
    routed: dict[str, int]
    stats: dict[str, Any] = field(default_factory=dict)
    cpu_s: float = 0.0
    swept: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self, records: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "system": self.system,
            "config": self.config,
            **self.summary,
            "utilisation": self.utilisation,
            "dispatch_reasons": self.dispatch_reasons,
            "routed": self.routed,
            "stats": self.stats,
            "cpu_s": self.cpu_s,
        }
        if self.swept:
            d["swept"] = self.swept
        if records:
            d["records"] = [
                {
                    "id": r.id,
                    "arrival_s": r.arrival_s,
                    "first_token_s": r.first_token_s,
                    "finish_s": r.finish_s,
                    "output_tokens": r.output_tokens,
                    "route": r.route,
                    "error": r.error,
                }
                for r in self.records
            ]
        return d


def _copy(m: Any, **update: Any) -> Any:
    return m.model_copy(update=update)


def variant(spec: EPDDeploymentSpec, system: str, allocation: Allocation | None = None) -> EPDDeploymentSpec:
    """The spec that ``system`` runs, derived from ``spec`` (and optionally another allocation)."""
    if system not in SYSTEMS:
        raise ValueError(f"system: must be one of {SYSTEMS}, got {system!r}")
    upd: dict[str, Any] = {}
    if allocation is not None:
        upd["allocation"] = allocation
    if system in ("easerve-s1", "dynamo"):
        upd["offload"] = _copy(spec.offload, ratio=1.0)
        upd["sm_partition"] = _copy(spec.sm_partition, mode=PartitionMode.NONE)
    if system == "dynamo":
        upd["encode"] = _copy(spec.encode, batch_bound=1, dispatch=DispatchPolicy.EAGER)
    return spec.model_copy(update=upd) if upd else spec


def _config(spec: EPDDeploymentSpec, system: str) -> dict[str, Any]:
    return {
        "allocation": spec.allocation.label(),
        "batch_bound": spec.encode.batch_bound,
        "dispatch": str(spec.encode.dispatch),
        "offload_ratio": spec.offload.ratio,
        "sm_partition": str(spec.sm_partition.mode) if spec.has_local_prefill else "none",
    }


def simulate_system(
    spec: EPDDeploymentSpec,
    requests: Sequence[Request],
    system: str = "easerve",
    model: StageModel | None = None,
    layout: tuple[int, ...] | None = None,
    host_gpus: int | None = None,
    frontends: int = 0,
    mps_caps: Mapping[str, float] | None = None,
    frontend_starts: Sequence[int] | None = None,
    kv_ipc: bool = True,
    door_capacity_rps: float | None = None,
) -> SimResult:
    """Run ONE configuration of ``system`` (no sweep).

    ``layout`` = (tp, replicas[, token_budget]) for aggregated. ``host_gpus``: the disaggregated
    pipeline runs on one host with that many GPUs, its processes time-slicing the GPUs they share
    (``sim.timeslice``); an aggregated replica has its GPUs to itself either way. ``frontends``: the
    disaggregated pipeline's requests pass that many frontends' admission control (``sim.frontdoor``);
    0 admits every request. ``mps_caps``: the pods that share host GPUs run under MPS with these
    per-stage SM caps instead of time-slicing (``sim.mpsshare``). ``frontend_starts``: the
    frontends' rotation starts (``run_pipeline``; None: spread evenly). ``kv_ipc``: KV handoffs on
    one GPU go by CUDA IPC (``run_pipeline``). ``door_capacity_rps``: the rate the frontends size
    their queues from (``run_pipeline``; None: the spec's profile's)."""
    t0 = time.process_time()
    if model is None:
        model = model_for(spec)
    if system == "aggregated":
        if layout is None:
            layout = aggregated_layouts(spec.gpu_budget, model)[0]
        tp, replicas = layout[0], layout[1]
        budget = layout[2] if len(layout) > 2 else DEFAULT_PREFILL_TOKEN_BUDGET
        jobs, stats = run_aggregated(requests, model, tp, replicas, budget)
        config: dict[str, Any] = {
            "layout": f"{replicas}x(E+P+D)(tp{tp})",
            "tp": tp,
            "replicas": replicas,
            "token_budget": budget,
        }
    else:
        v = variant(spec, system)
        factory: Callable[[], Any] | None = None
        if system == "dynamo":
            half_life = v.encode.rate_half_life_ms / 1000.0

            def factory() -> Any:
                return EagerBatcher(1, half_life_s=half_life)

        jobs, stats = run_pipeline(v, requests, model, batcher_factory=factory, host_gpus=host_gpus,
                                   frontends=frontends, mps_caps=mps_caps, frontend_starts=frontend_starts,
                                   kv_ipc=kv_ipc, door_capacity_rps=door_capacity_rps)
        config = _config(v, system)
    records = [j.rec for j in jobs]
    for j in jobs:
        j.rec.route = j.route
    summary = summarize(records, spec.slo)
    return SimResult(
        system=system,
        config=config,
        records=records,
        summary=summary,
        utilisation=stats.pop("utilisation"),
        dispatch_reasons=stats.pop("dispatch_reasons"),
        routed=stats.pop("routed"),
        stats=stats,
        cpu_s=time.process_time() - t0,
    )


def rank_key(summary: dict[str, Any], tier: str) -> tuple[float, float, float]:
    """Higher is better: goodput at ``tier``, then throughput, then lower mean TTFT."""
    return (summary["goodput"].get(tier, 0.0), summary["throughput"], -summary["ttft_mean"])


def best_of(
    spec: EPDDeploymentSpec,
    requests: Sequence[Request],
    system: str,
    model: StageModel | None = None,
    tier: str | None = None,
    candidates: Sequence[Any] | None = None,
) -> SimResult:
    """``system`` at its best configuration for these requests (a real sweep, recorded in ``swept``).

    ``dynamo`` and ``easerve-s1`` sweep every feasible allocation; ``aggregated`` every TP layout
    and chunked-prefill token budget;
    ``easerve`` runs the spec as given unless ``candidates`` (specs) are passed.
    """
    if model is None:
        model = model_for(spec)
    tier = tier or spec.slo.objective
    t0 = time.process_time()
    results: list[SimResult] = []
    if system == "aggregated":
        layouts = candidates or [
            (tp, n, b)
            for tp, n in aggregated_layouts(spec.gpu_budget, model)
            for b in AGGREGATED_TOKEN_BUDGETS
        ]
        for layout in layouts:
            results.append(simulate_system(spec, requests, system, model, layout=layout))
    elif system in ("dynamo", "easerve-s1"):
        allocs = candidates or feasible_allocations(spec.gpu_budget, model)
        for a in allocs:
            s = spec.model_copy(update={"allocation": a}) if isinstance(a, Allocation) else a
            results.append(simulate_system(s, requests, system, model))
    else:
        for s in candidates or [spec]:
            results.append(simulate_system(s, requests, system, model))
    best = max(results, key=lambda r: rank_key(r.summary, tier))
    best.swept = [
        {
            "config": r.config,
            "goodput": r.summary["goodput"].get(tier, 0.0),
            "throughput": r.summary["throughput"],
            "ttft_p99": r.summary["ttft_p99"],
        }
        for r in results
    ]
    best.cpu_s = time.process_time() - t0
    return best


def model_for(spec: EPDDeploymentSpec) -> StageModel:
    """The stage model of the spec's latency profile (``profiles.spec_profile``: a shipped name,
    a file or a ConfigMap; a bad one is a ``SpecError`` naming the field)."""
    from easerve_runtime.profiles import spec_profile

    return StageModel(spec_profile(spec))
