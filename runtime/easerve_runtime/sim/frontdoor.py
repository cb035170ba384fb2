"""The frontends' admission control in the twin: the live ``AdmissionQueue``, one per frontend.

Why: a deployment refuses requests at the door (429) once the requests waiting for a first token
reach the bound ``policies.admission`` sizes from the profile's saturation rate. A twin that
admits everything predicts a longer tail and more completions than the deployment serves. On the
local cluster (issue 13, must-hold 3; sim pods, so the twin should match) the trials whose
capacity estimate lies under the offered rate refused 1-4 of 100 requests, and those were the
slowest ones: the cluster's throughput read 4.2-4.6 % under the twin's and its P99 TTFT 0.65-0.80
of it, on exactly those trials.

The bound is computed as the live frontend computes it (``workers.frontend.measured_capacity``):
the spec's saturation rate (``profiles.capacity.saturation_rps``, the same profile file the pods
read, not the twin's possibly recalibrated model), on ``host_gpus`` shared GPUs when given, split
over ``frontends`` frontends (``topology.frontends_for``: one per encode pod on Kubernetes; one under
``easerve serve``). ``capacity_rps`` gives that rate instead, for a twin whose spec carries another
profile than the pods read (``benchmarks/twin_agreement.py`` predicts H100 runs whose frontends
sized their queues from the H200 profile they were served with). The queue itself is built by
``policies.admission.admission_queue``, as live.
Requests are dealt to the frontends round-robin, as the kubelet harness's kube-proxy deals
connections (a real kube-proxy in iptables mode picks at random). A refused request records the
frontend's 429 reason as its error: it counts as failed, never completed.
"""

from __future__ import annotations

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.policies.admission import AdmissionQueue, admission_queue
from easerve_runtime.sim.stages import Job


class FrontDoor:
    """``frontends`` admission queues over the twin's virtual time."""

    def __init__(self, spec: EPDDeploymentSpec, frontends: int, host_gpus: int | None = None,
                 capacity_rps: float | None = None) -> None:
        from easerve_runtime.profiles.capacity import saturation_rps

        if frontends < 1:
            raise ValueError(f"frontends: must be >= 1, got {frontends}")
        total = saturation_rps(spec, host_gpus=host_gpus) if capacity_rps is None else capacity_rps
        cap = total / frontends
        self.queues = [admission_queue(spec.limits, cap) for _ in range(frontends)]
        self.capacity_rps = cap
        self._of: dict[int, AdmissionQueue] = {}
        self._index: dict[int, int] = {}
        self._next = 0

    @property
    def bound(self) -> int:
        """Each frontend's initial bound (what the live frontend logs at start)."""
        return self.queues[0].max_bound

    @property
    def refused(self) -> int:
        return sum(q.refused for q in self.queues)

    def admit(self, job: Job, now: float) -> bool:
        """Deal ``job`` to the next frontend; False (and the job's error set) when refused."""
        i = self._next
        q = self.queues[i]
        self._next = (self._next + 1) % len(self.queues)
        decision = q.admit(now)
        if not decision.admitted:
            job.rec.error = f"{decision.status}: {decision.reason}"
            return False
        self._of[id(job)] = q
        self._index[id(job)] = i
        return True

    def frontend(self, job: Job) -> int:
        """Which frontend admitted ``job`` (0 .. frontends - 1)."""
        return self._index[id(job)]

    def first_token(self, job: Job) -> None:
        """The job's first token is out: it leaves its frontend's queue (and adapts the bound)."""
        q = self._of.pop(id(job), None)
        if q is not None and job.rec.first_token_s is not None:
            q.first_token(job.rec.first_token_s, job.rec.first_token_s - job.rec.arrival_s)
