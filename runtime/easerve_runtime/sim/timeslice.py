"""Processes that share one physical GPU without MPS time-slice it; the twin charges that at dispatch.

Why: on a Kubernetes node every pod gets GPUs of its own, and the twin gives each worker its own.
``easerve serve`` on a host with fewer GPUs than the deployment asks for wraps the placement
(``workers.launcher.visible_devices``): on one H200 every process of a deployment runs on the same
GPU. There the measured runs differ from the twin the way time-slicing predicts: decode's TPOT p50
was 1.4–2.3x the twin's, and P99 TTFT 1.7–7x (``benchmarks/twin_agreement.py``, runs 8–9), because
the decode process's steps, the encoder's batches and the prefills' forwards take turns on the
GPU instead of running side by side.

The model: while k processes have work in flight on a GPU, the device alternates between their
contexts, so each runs at about 1/k of its own pace. The twin's workers time their work when they
dispatch it, so the charge is made then: a piece of work of nominal duration d, dispatched while
m other pods on any of its GPUs have work in flight, takes (1 + m) * d, and keeps its pod busy
until it ends. Work that starts later does not re-time work in flight (as
the SM-sharing charges of ``sim.shares`` do), so overlap is charged to whichever side dispatched
second.

Measured against the GPU (``benchmarks/timeslice_law.py``, run 13, docs/benchmarks.md): two
processes on one H200, a decode-like graph loop against prefill-like bursts, share it close to
processor sharing. This rule gets the decode side within 0-8 % and charges the burst side 2x where
the GPU gives 1.73-1.84x (the loop's host pause, which the rule counts as busy, leaves the GPU to the
bursts). The served runs miss the twin by more than that (TPOT p50 20-40 % short under load): the
gap is in what the served pods run beyond the profiled forwards, not in this rule.

The unit is the pod replica, not the process: the processes of one pod that share a GPU are an
encode pod's encode workers and its local prefill, which the SM partition splits (green contexts
in one process, or MPS between processes), and ``sim.shares`` models that split; they do not
time-slice each other. ``placement(topology, host_gpus)`` maps each pod replica to the host GPUs
its processes run on, from the same placement ``easerve serve`` uses (``Topology.placed``, modulo
the host's GPU count). A pod that spans several GPUs counts as busy on all of them (coarse where
a host holds part of a pod's GPUs; exact when one GPU holds everything, the runs it was built for).
Without a host GPU count (the Kubernetes case), or with enough GPUs for every pod, nothing is
shared and every factor is exactly 1.
"""

from __future__ import annotations

from easerve_runtime.sim.events import EventLoop
from easerve_runtime.topology import Topology


def pod_key(stage: str, replica: int) -> str:
    """A pod replica's name in the twin (the unit that time-slices a shared GPU)."""
    return f"{stage}/{replica}"


def pod_stage(key: str) -> str:
    """The stage of pod replica ``key`` (``pod_key``'s inverse, stage part)."""
    return key.split("/", 1)[0]


def placement(topo: Topology, host_gpus: int | None) -> dict[str, frozenset[int]]:
    """Per pod replica (``pod_key``), the host GPUs its processes run on; empty when ``host_gpus`` is
    None or when no GPU is used by two pod replicas."""
    if not host_gpus:
        return {}
    out: dict[str, frozenset[int]] = {}
    for pod, replica, _proc, gpus in topo.placed():
        key = pod_key(str(pod.stage), replica)
        out[key] = out.get(key, frozenset()) | frozenset(g % host_gpus for g in gpus)
    out = {k: v for k, v in out.items() if v}
    if not any(a != b and out[a] & out[b] for a in out for b in out):
        return {}
    return out


class TimeSlicing:
    """Which pod replicas have work in flight on which host GPUs, and the factor new work pays for it."""

    def __init__(self, loop: EventLoop, devices: dict[str, frozenset[int]]) -> None:
        self.loop = loop
        self.devices = devices
        self.busy_until: dict[str, float] = {}
        self.charged = 0  # dispatches that paid a factor > 1 (for reports)
        self.dispatches = 0

    def dilation(self, proc: str, work: str = "") -> float:
        """The factor on a piece of work pod replica ``proc`` dispatches now: 1 + the other pod
        replicas with work in flight on any GPU it runs on (whatever the ``work``)."""
        mine = self.devices.get(proc)
        if not mine:
            return 1.0
        now = self.loop.now
        others = sum(1 for p, until in self.busy_until.items()
                     if p != proc and until > now and self.devices.get(p, frozenset()) & mine)
        self.dispatches += 1
        if others:
            self.charged += 1
        return 1.0 + others

    def decode_rows_s(self, proc: str, rows: int) -> float:
        """Time-slicing charges a decode step no per-row term (``MPSSharing`` does, beside capped pods)."""
        return 0.0

    def occupy(self, proc: str, until: float) -> None:
        """Pod replica ``proc`` has work in flight until ``until``."""
        if proc in self.devices:
            self.busy_until[proc] = max(until, self.busy_until.get(proc, until))
