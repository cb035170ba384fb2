"""The twin as HAS's trial runner and profiler (adapters over ``easerve_runtime.sim``).

The runtime may not import the operator, so the twin's runner returns a plain dict and its
profiler its own ``Probe``; these adapters give HAS the ``TrialRunner`` / ``Profiler`` shapes
(``TrialMetrics``; ``Probe`` with ``value`` and ``cost_s``). ``cost_s`` is virtual time: the
device time a real trial or profile run would take.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from easerve_runtime.api import EPDDeploymentSpec

from easerve_operator.tuning.runners import Probe, TrialMetrics

DEFAULT_PROFILE_REQUESTS = 256


class SimRunner:
    """``TrialRunner`` on the discrete-event twin (system ``easerve``, the spec as given).

    ``host_gpus``: trials run on one host with that many GPUs, the candidate's pods time-slicing
    the GPUs they share (what a deployment on fewer GPUs than its topology gets: the launcher wraps
    its GPUs onto the host's); default every pod on GPUs of its own, as on a cluster. ``mps_caps``:
    those pods run under MPS with these per-stage SM caps (``easerve serve --mps-share``).
    ``frontends``: how many frontends admit the trial's requests (default: the deployment's own,
    ``sim.runner.run_trial``; 0 admits every request)."""

    def __init__(self, arrival: str = "poisson", cv: float = 1.0, host_gpus: int | None = None,
                 mps_caps: Mapping[str, float] | None = None, frontends: int | None = None) -> None:
        from easerve_runtime.sim.runner import SimTrialRunner

        self._inner = SimTrialRunner(arrival=arrival, cv=cv, host_gpus=host_gpus, mps_caps=mps_caps,
                                     frontends=frontends)
        self.last: dict[str, Any] = {}

    def run_trial(self, spec: EPDDeploymentSpec, rate: float, requests: int, seed: int) -> TrialMetrics:
        d = self._inner.run_trial(spec, rate, requests, seed)
        self.last = d
        return TrialMetrics.from_dict(d)


class SimStageProfiler:
    """``Profiler`` on the twin: each stage's worker class alone under a stress workload.

    α needs care. The twin's ``SimProfiler.local_prefill_efficiency`` measures the local worker
    at the SM share it keeps *while a micro-batch encodes*. Under ``dynamic`` partitioning that
    share is about 0 (the encoder takes the whole GPU for its batch), yet the local worker gets
    the whole GPU whenever the encoder is idle, which at Λ far below C_E is most of the time.
    Given the target ``rate``, this adapter therefore reports the time average over the
    encoder's duty cycle u = min(1, Λ / C_E) (one encode worker taking all of Λ: the
    conservative end):

        α = (1 − u)·α_idle + u·α_busy,  α_idle = C_local(idle share) / C_P(min TP)

    clipped to [0, 1]. The partition mode is the one the candidates will run with: the spec's,
    or ``dynamic`` when the spec has none (see ``space.apply_candidate``). Without ``rate`` it
    returns the twin's own (busy-share) α. ``alpha_parts`` keeps the pieces for the report.
    """

    def __init__(
        self,
        spec: EPDDeploymentSpec,
        requests: int = DEFAULT_PROFILE_REQUESTS,
        seed: int = 0,
        rate: float | None = None,
    ) -> None:
        from easerve_runtime.api import OffloadSpec, PartitionMode
        from easerve_runtime.sim.profiler import SimProfiler

        mode = spec.sm_partition.mode
        if mode == PartitionMode.NONE:
            mode = PartitionMode.DYNAMIC.value
        local_spec = spec.model_copy(
            update={
                "offload": OffloadSpec(ratio=min(spec.offload.ratio, 0.5)),
                "sm_partition": spec.sm_partition.model_copy(update={"mode": mode}),
            }
        )
        self._inner = SimProfiler(local_spec, n_requests=requests, seed=seed)
        self._local_spec = local_spec
        self.rate = rate
        self.alpha_parts: dict[str, float] = {}

    def min_tp(self) -> int:
        return int(self._inner.min_tp())

    def local_prefill_tp(self) -> int:
        """TP of the twin's local prefill worker: it spans ``min_tp`` encode GPUs (the backbone must fit)."""
        return self.min_tp()

    def encode_throughput(self, batch: int) -> Probe:
        p = self._inner.encode_throughput(batch)
        return Probe(float(p.value), float(p.cost_s))

    def prefill_capacity(self, tp: int) -> Probe:
        p = self._inner.prefill_capacity(tp)
        return Probe(float(p.value), float(p.cost_s))

    def decode_capacity(self, tp: int) -> Probe:
        p = self._inner.decode_capacity(tp)
        return Probe(float(p.value), float(p.cost_s))

    def local_shares(self) -> tuple[float, float]:
        """(busy, idle): the local prefill worker's SM share while a micro-batch encodes, and while the
        encoder is idle, under the candidates' partition (the policy's decision, not a measurement)."""
        from easerve_runtime.sim.shares import ShareModel

        share, dilation = ShareModel(self._local_spec, self._inner.model, colocated=True).local_share(None, True)
        return float(self._inner.local_share()), share / dilation

    def local_prefill_efficiency(self) -> float | None:
        busy = self._inner.local_prefill_efficiency()
        if busy is None or self.rate is None:
            return None if busy is None else min(1.0, max(0.0, float(busy)))
        _, idle_share = self.local_shares()
        c_p = self._inner.prefill_capacity(self.min_tp()).value
        idle_cap = self._inner.local_prefill_capacity(idle_share).value
        c_e = self._inner.encode_capacity()[0]
        alpha, self.alpha_parts = duty_alpha(busy, idle_cap / c_p if c_p > 0 else 0.0, c_e, self.rate)
        return alpha


def duty_alpha(busy: float, idle: float, c_e: float, rate: float) -> tuple[float, dict[str, float]]:
    """α over the encoder's duty cycle u = min(1, Λ / C_E): (1 − u)·α_idle + u·α_busy, clipped to
    [0, 1] (see ``SimStageProfiler``); also the parts, for the report. The cluster's profiler
    (``runners.kube_profile``) combines its measured shares the same way."""
    u = min(1.0, rate / c_e) if c_e > 0 else 1.0
    alpha = (1.0 - u) * idle + u * float(busy)
    return min(1.0, max(0.0, alpha)), {"busy": float(busy), "idle": idle, "encoder_duty": u, "alpha": alpha}
