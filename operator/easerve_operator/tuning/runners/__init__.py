"""The two small interfaces HAS talks through: ``TrialRunner`` and ``Profiler``.

WHY so small: the twin implements them today (``runners.sim``), and a later Kubernetes runner
(roll out a candidate, drive load, read Prometheus) must be able to implement them with no
change to the search. A runner only has to turn one candidate ``EPDDeploymentSpec`` into one
``TrialMetrics``; a profiler only has to answer four capacity questions. Both report
``cost_s``, the device time the measurement took (virtual time on the twin, wall time on a
cluster), so a search can account for what it spent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from easerve_runtime.api import EPDDeploymentSpec


@dataclass(frozen=True)
class TrialMetrics:
    """What one end-to-end trial measured.

    ``throughput`` is completed requests per second; ``goodput`` maps an SLO tier name to its
    goodput (req/s); ``ttft_mean`` is seconds and ``tpot_mean`` seconds per token (means are the
    lexicographic tie-breakers). ``cost_s`` is the device time the trial took.
    """

    throughput: float
    ttft_mean: float
    tpot_mean: float
    goodput: Mapping[str, float] = field(default_factory=dict)
    ttft_p99: float | None = None
    tpot_p99: float | None = None
    completed: int = 0
    cost_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "throughput": self.throughput,
            "ttft_mean": self.ttft_mean,
            "tpot_mean": self.tpot_mean,
            "goodput": dict(self.goodput),
            "ttft_p99": self.ttft_p99,
            "tpot_p99": self.tpot_p99,
            "completed": self.completed,
            "cost_s": self.cost_s,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialMetrics:
        return cls(
            throughput=float(d["throughput"]),
            ttft_mean=float(d["ttft_mean"]),
            tpot_mean=float(d["tpot_mean"]),
            goodput={str(k): float(v) for k, v in dict(d.get("goodput") or {}).items()},
            ttft_p99=None if d.get("ttft_p99") is None else float(d["ttft_p99"]),
            tpot_p99=None if d.get("tpot_p99") is None else float(d["tpot_p99"]),
            completed=int(d.get("completed", 0)),
            cost_s=float(d.get("cost_s", 0.0)),
        )


@dataclass(frozen=True)
class Probe:
    """One profiling measurement: a capacity (requests/s) and the device time it cost."""

    value: float
    cost_s: float = 0.0


@runtime_checkable
class TrialRunner(Protocol):
    """Runs one candidate configuration end to end and measures it.

    ``spec`` is a complete, validated candidate (allocation, ``encode.batch_bound`` and
    ``offload.ratio`` already set). ``rate`` is the target arrival rate Λ (req/s), ``requests``
    the number of requests to send, ``seed`` the workload seed: HAS passes the same seed to every
    trial so that candidates are compared on the same requests (common random numbers).
    Raise an exception for a trial that could not run; the search records it as failed.
    """

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> TrialMetrics: ...


@runtime_checkable
class Profiler(Protocol):
    """Per-stage capacity measurements for Stage 1 (one isolated worker each).

    All capacities are in requests per second of the deployment's workload, so they compare
    directly with Λ. The methods may be called from different threads at once (Stage 1 runs the
    three profiles concurrently, as the paper runs them on disjoint GPUs).
    """

    def min_tp(self) -> int:
        """Smallest tensor-parallel degree at which the model fits one worker's GPUs."""
        ...

    def encode_throughput(self, batch: int) -> Probe:
        """Saturated throughput of ONE encode worker (TP 1) at encode batch bound ``batch``."""
        ...

    def prefill_capacity(self, tp: int) -> Probe:
        """Capacity of ONE remote prefill worker at tensor parallelism ``tp`` (stress workload)."""
        ...

    def decode_capacity(self, tp: int) -> Probe:
        """Capacity of ONE decode worker at tensor parallelism ``tp`` (stress workload)."""
        ...

    def local_prefill_efficiency(self) -> float | None:
        """α: a local prefill worker's capacity at its SM share, as a fraction of ``C_P``.

        ``None`` when unknown; Stage 1 then uses its documented default.
        """
        ...
