"""The discrete-event twin of the EPD pipeline, and the baselines it is compared against.

It drives the SAME policy objects as the runtime (batchers, deficit router, least-outstanding
picker, SM-split policy) and reads the SAME latency profiles as the runtime's sim engine, in
virtual time, so a 500-request run takes well under a second of CPU. See docs/twin.md.

    simulate(spec, requests, system="easerve") -> SimResult
    run_trial(spec, rate, n_requests, seed) -> dict            (HAS TrialRunner, sim/runner.py)
    SimProfiler(spec).encode_throughput(b) / prefill_capacity(tp) / ...   (HAS Profiler)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.sim.systems import SYSTEMS, SimResult, best_of, model_for, simulate_system, variant
from easerve_runtime.workload.request import Request


def simulate(
    spec: EPDDeploymentSpec,
    requests: Sequence[Request],
    system: str = "easerve",
    *,
    sweep: bool | None = None,
    model: Any = None,
) -> SimResult:
    """Simulate ``requests`` on ``system`` under ``spec``; deterministic for a given request list.

    ``sweep`` (default: True for the baselines ``dynamo`` and ``aggregated``, False for ours) gives
    the system its best configuration for the GPU budget instead of the spec's allocation.
    """
    if system not in SYSTEMS:
        raise ValueError(f"system: must be one of {SYSTEMS}, got {system!r}")
    if sweep is None:
        sweep = system in ("dynamo", "aggregated")
    m = model if model is not None else model_for(spec)
    if sweep:
        return best_of(spec, requests, system, m)
    return simulate_system(spec, requests, system, m)


__all__ = ["SYSTEMS", "SimResult", "best_of", "model_for", "simulate", "simulate_system", "variant"]
