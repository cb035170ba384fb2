"""The twin as HAS's trial runner and profiler (adapters over ``easerve_runtime.sim``).

The runtime may not import the operator, so the twin's runner returns a plain dict and its
profiler its own ``Probe``; these adapters give HAS the ``TrialRunner`` / ``Profiler`` shapes
(``TrialMetrics``; ``Probe`` is duck-typed: ``value`` and ``cost_s``). ``cost_s`` is virtual
time: the device time a real trial or profile run would take.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.config import EPDDeploymentSpec

from easerve_operator.tuning.runners import Probe, TrialMetrics

DEFAULT_PROFILE_REQUESTS = 256


class SimRunner:
    """``TrialRunner`` on the discrete-event twin (system ``easerve``, the spec as given)."""

    def __init__(self, arrival: str = "poisson", cv: float = 1.0) -> None:
        from easerve_runtime.sim.runner import SimTrialRunner

        self._inner = SimTrialRunner(arrival=arrival, cv=cv)
        self.last: dict[str, Any] = {}

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> TrialMetrics:
        d = self._inner.run_trial(spec, rate, requests, seed)
        self.last = d
        return TrialMetrics.from_dict(d)


class SimStageProfiler:
    """``Profiler`` on the twin: each stage's worker class alone under a stress workload."""

    def __init__(
        self, spec: EPDDeploymentSpec, requests: int = DEFAULT_PROFILE_REQUESTS, seed: int = 0
    ) -> None:
        from easerve_runtime.sim.profiler import SimProfiler

        self._inner = SimProfiler(spec, n_requests=requests, seed=seed)

    def min_tp(self) -> int:
        return int(self._inner.min_tp())

    def encode_throughput(self, batch: int) -> Probe:
        p = self._inner.encode_throughput(batch)
        return Probe(float(p.value), float(p.cost_s))

    def prefill_capacity(self, tp: int) -> Probe:
        p = self._inner.prefill_capacity(tp)
        return Probe(float(p.value), float(p.cost_s))

    def decode_capacity(self, tp: int) -> Probe:
        p = self._inner.decode_capacity(tp)
        return Probe(float(p.value), float(p.cost_s))

    def local_prefill_efficiency(self) -> float | None:
        a = self._inner.local_prefill_efficiency()
        return None if a is None else float(a)
