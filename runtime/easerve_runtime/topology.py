"""What runs where: ``plan(spec) -> Topology``, the one place that decides a deployment's layout.

A deployment is a list of pod shapes (one per Kubernetes Deployment), each with a replica count
and the processes one pod runs: their stage, the GPUs they request (own) or share, their ports,
the policy objects they run and their exact ``easerve ...`` argv. Three shells read it and none
of them decides layout on its own:

- the operator's renderer turns each pod into a Deployment (and Service) and each process into a
  container (``easerve_operator.render``);
- ``easerve serve`` (``workers/launcher.py``) starts each process of each replica locally,
  partition controllers included;
- the twin (``sim/twin.py``) builds one simulated worker per process.

**Local prefill spanning several encode GPUs.** A local prefill worker runs the whole backbone.
When the backbone needs TP k > 1 on the profile's GPU (a 27–34B model on a 48 GB GPU needs
k = 2), one local prefill worker of TP k spans k encode GPUs, each giving it its complementary
SM share (the EAServe testbed: 2E(TP1) with local prefill on RTX 6000 Ada). A process can only
use the GPUs of its own pod, so those k encode GPUs live in ONE encode pod: ``encode-0 ..
encode-(k-1)`` (one GPU each), one ``local-prefill`` sharing all k, one partition controller per
GPU, one frontend. With k = 1 the pod is the familiar frontend + encode + local-prefill +
partition-controller. ``spec.allocation.encode.replicas`` must then be a multiple of k (encode
GPUs left over would form a second pod shape with no local partner); otherwise ``plan`` raises a
``SpecError`` naming that field.

**Local prefill inside the encode process (torch engine).** With ``engine.backend: torch`` each
encode worker process also runs its GPU's local prefill worker (``local_prefill_in_encode``, the
one decision; the workers read it too): without MPS, kernels of two processes on one GPU
time-slice, so the green-context split of the GPU between encode and local prefill is only
enforced concurrently when one process holds both engines. The encode process then carries
``hosts=(Stage.LOCAL_PREFILL,)`` and the pod has no ``local-prefill`` container. The torch engine
has no tensor parallelism, so that local prefill is TP 1 on its own encode GPU (k = 1 whatever
the profile says). The sim engine keeps its separate local prefill process.

Pure: no I/O except reading the shipped latency profile by name when the caller does not pass
``Hardware`` (``hardware_for``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from easerve_runtime.api import (
    CONFIG_PATH,
    HTTP_PORT,
    SYSTEM_PORT,
    Backend,
    DeploymentMode,
    DiscoveryBackend,
    EPDDeploymentSpec,
    LocalPrefillProcess,
    PartitionMode,
    SpecError,
    Stage,
)

SHARED_GPUS_ENV = "EASERVE_SHARED_GPUS"
"""Set by ``easerve serve`` when the deployment places more GPUs than the host has: how many GPUs
its pods time-slice (the frontend sizes its admission queue from that, ``profiles.capacity``).
Never set in Kubernetes, where every pod has GPUs of its own."""
PARTITION_GPU_ENV = "EASERVE_PARTITION_GPU"
"""Pod-local GPU index (or comma list) of the partition records a worker reads; the launcher
maps it to a host-unique index."""
SHARE_GPU_ENV: dict[str, str] = {}
"""Nothing: a container sees exactly the devices the kubelet assigned to it, never ``all``
(``NVIDIA_VISIBLE_DEVICES=all`` would hand a sidecar every GPU of the node). A container that
shares its pod's GPU without requesting it (local prefill, partition controller, omni
downstream) therefore gets no device from the renderer: on a real GPU node that sharing needs
dynamic resource allocation (newer clusters) or both engines in one process; see
docs/operator.md."""


@dataclass(frozen=True)
class Port:
    """A port a process listens on inside its pod (containers of a pod share one network)."""

    name: str  # container port name, at most 15 characters
    number: int


@dataclass(frozen=True)
class Process:
    """One process of a pod: one container in Kubernetes, one child process under ``easerve serve``."""

    name: str
    """Container name, unique in its pod: ``encode``, ``encode-1``, ``local-prefill``, ..."""
    stage: Stage
    argv: tuple[str, ...]
    """The exact command (``easerve worker --stage ...``); the image's entrypoint runs it."""
    gpus: int = 0
    """GPUs this process requests: it owns them (``nvidia.com/gpu``)."""
    owns: tuple[int, ...] = ()
    """Pod-local indices of the GPUs it owns."""
    shares: tuple[int, ...] = ()
    """Pod-local indices of GPUs it uses without requesting them (owned by another process)."""
    tp: int = 1
    """Tensor parallelism of its engine."""
    ports: tuple[Port, ...] = ()
    system_port: int | None = None
    """Where its system server (/health, /live, /metrics) listens (``DYN_SYSTEM_PORT``)."""
    http_port: int | None = None
    """Where it serves the OpenAI HTTP API (frontend, omni-shared)."""
    probe: str | None = None
    """Port name its readiness/liveness probes hit; None: no HTTP endpoint (an idle loop)."""
    partition_gpus: tuple[int, ...] = ()
    """Pod-local GPUs whose SM-partition record it takes part in (worker) or writes (controller)."""
    shm: bool = False
    """Shares the pod's memory-backed /dev/shm (SM-partition control records)."""
    policies: tuple[str, ...] = ()
    """The policy objects it runs, ``kind:name`` (e.g. ``batcher:poisson-gap``, ``router:deficit``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Process-specific environment, in order (GPU sharing, partition record index)."""
    hosts: tuple[Stage, ...] = ()
    """Stages it runs in-process beside its own (an encode worker hosting its GPU's local prefill
    worker, ``local_prefill_in_encode``): no container of their own."""

    @property
    def health_port(self) -> int | None:
        """The port whose /health answers (HTTP for the frontend, else the system server)."""
        return self.http_port if self.probe == "http" else self.system_port if self.probe else None


@dataclass(frozen=True)
class Pod:
    """One pod shape; ``replicas`` identical pods of it run."""

    stage: Stage
    """The Deployment's stage label: encode, prefill, decode or omni."""
    replicas: int
    processes: tuple[Process, ...]
    service_ports: tuple[Port, ...]
    """Ports its Service exposes (target: the container port of the same name)."""
    metrics_port: int
    """Where Prometheus scrapes the pod."""

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.processes)

    @property
    def shm(self) -> bool:
        return any(p.shm for p in self.processes)

    @property
    def node_gpus(self) -> int:
        """Distinct GPUs one replica of this pod occupies on its node (owned or shared by its processes)."""
        return len({g for p in self.processes for g in (*p.owns, *p.shares)})

    def process(self, stage: Stage) -> list[Process]:
        return [p for p in self.processes if p.stage == stage]

    def workers(self, stage: Stage) -> list[Process]:
        """The processes running a ``stage`` worker: as their own stage, or hosting it in-process."""
        return [p for p in self.processes if p.stage == stage or stage in p.hosts]


@dataclass(frozen=True)
class Topology:
    mode: DeploymentMode
    pods: tuple[Pod, ...]
    local_prefill_tp: int = 1
    """GPUs (and encode GPUs) one local prefill worker spans; 1 without local prefill."""

    def pod(self, stage: Stage) -> Pod:
        for p in self.pods:
            if p.stage == stage:
                return p
        raise KeyError(stage)

    @property
    def gpus(self) -> int:
        return sum(p.gpus * p.replicas for p in self.pods)

    def replicas(self) -> Iterator[tuple[Pod, int]]:
        """Every pod replica, in plan order (downstream first, so workers exist before clients)."""
        for pod in self.pods:
            for r in range(pod.replicas):
                yield pod, r

    def placed(self) -> Iterator[tuple[Pod, int, Process, tuple[int, ...]]]:
        """Every process of every pod replica, in plan order, with the node GPU indices it runs on
        (owned, then shared): pod replicas take consecutive GPUs of one node, as a scheduler
        packing one node would, and as ``easerve serve`` places them on its host. The twin reads
        the same placement to know which processes share a GPU on a host with fewer GPUs."""
        next_gpu = 0
        for pod, replica in self.replicas():
            first = next_gpu
            next_gpu += pod.node_gpus
            for proc in pod.processes:
                yield pod, replica, proc, tuple(first + g for g in (*proc.owns, *proc.shares))


@dataclass(frozen=True)
class Hardware:
    """What the layout needs from the latency profile (the caller's, or the shipped one by name)."""

    local_prefill_tp: int = 1
    """The backbone's smallest TP on the profile's GPU (``Profile.min_tp()``)."""
    total_sms: int | None = None
    """SMs of the profile's GPU: the partition controller's SM count where NVML cannot tell
    (a CPU node running the sim engine); the dynamic table is built for the same count."""
    omni_throttle: dict[str, Any] = field(default_factory=dict)
    """Omni profiles: the bandwidth throttle's ladder, s_aggr, b_sat, gamma and total_sms."""


def hardware_for(spec: EPDDeploymentSpec) -> Hardware:
    """Read what ``plan`` needs from the spec's latency profile (only when the layout needs it).

    The profile comes through the one loader (``profiles.spec_profile`` / ``profile_path``), so a
    shipped name, a file or a mounted ConfigMap all work. A profile file that is not readable here
    (the operator does not see the pods' ConfigMap mount) lays out local prefill at TP 1; the
    workers re-check the profile when they start.
    """
    from easerve_runtime.profiles.source import ProfileFileError, profile_path, profile_source, spec_profile

    src = profile_source(spec)
    readable = src.path() is None or bool(src.path() and src.path().exists())  # type: ignore[union-attr]
    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        if spec.sm_partition.mode == PartitionMode.NONE or not readable:
            return Hardware()
        from easerve_runtime.omni.profile import load_omni_profile

        try:
            omni = load_omni_profile(profile_path(spec))
        except (KeyError, ValueError) as exc:
            raise _profile_error(exc, src.field) from exc
        return Hardware(omni_throttle={**omni.throttle, "total_sms": omni.total_sms})
    if not spec.has_local_prefill or not readable:
        return Hardware()
    try:
        profile = spec_profile(spec)
    except SpecError:
        raise
    except (KeyError, ValueError, ProfileFileError) as exc:
        raise _profile_error(exc, src.field) from exc
    return Hardware(local_prefill_tp=profile.min_tp(), total_sms=profile.sms)


def _profile_error(exc: Exception, path: str = "spec.engine.profile") -> SpecError:
    msg = str(exc).strip("'\"")
    return SpecError(path, msg.removeprefix(f"{path}: "))


def _worker_argv(stage: str) -> tuple[str, ...]:
    return ("easerve", "worker", "--stage", str(stage), "--config", CONFIG_PATH)


def plan(spec: EPDDeploymentSpec, hardware: Hardware | None = None) -> Topology:
    """The deployment's pods and processes. ``hardware`` defaults to ``hardware_for(spec)``."""
    hw = hardware if hardware is not None else hardware_for(spec)
    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        return _plan_omni(spec, hw)
    if spec.mode == DeploymentMode.AGGREGATED:
        return _plan_aggregated(spec)
    return _plan_disaggregated(spec, hw)


def frontends(topo: Topology) -> int:
    """How many frontends serve a layout: one per replica of every pod that runs one.

    Why it is counted from the layout and not from the allocation: the frontend runs in the encode
    pod, and with local prefill of TP k an encode pod holds k encode GPUs (its local prefill
    worker's TP group), so ``2E`` at TP 2 is one pod and one frontend, not two. Each frontend
    admits its share of the deployment's capacity (``workers.frontend.measured_capacity``); counting
    encode GPUs instead halved the door of such a layout (issue 13: a trial of 2E-1P(tp2)-1D(tp4)
    refused 35 of 300 requests where the twin, told of two frontends, refused 9).
    """
    n = sum(p.replicas for p in topo.pods if any(q.stage == Stage.FRONTEND for q in p.processes))
    return max(1, n)


SINGLE_HOST_FRONTENDS = 1
"""Frontends of a deployment whose processes all run on one host (``easerve serve``): one, which
admits for all. The launcher tells the frontend so (``EASERVE_FRONTENDS``) and the twin's trials of
such a host admit through that many (``sim.runner.run_trial``)."""


def frontends_for(spec: EPDDeploymentSpec, hardware: Hardware | None = None) -> int:
    """``frontends(plan(spec, hardware))``: the frontends of the pods the operator renders for
    ``spec`` (one per encode pod; one per engine in aggregated mode). ``easerve serve`` runs one
    and says so (``EASERVE_FRONTENDS``)."""
    return frontends(plan(spec, hardware))


def frontends_ranked(spec: EPDDeploymentSpec) -> bool:
    """Do the deployment's frontends rank themselves among each other (``workers.frontend_rank``)
    and so start their encode rotations evenly spread, as the twin does? Yes where Dynamo's
    discovery lists each process's instances by lease (``etcd``, ``file``); with ``kubernetes`` a
    frontend keeps a start hashed from its pod and process, a fresh draw per roll-out."""
    return str(spec.discovery.backend) != DiscoveryBackend.KUBERNETES


def local_prefill_in_encode(spec: EPDDeploymentSpec) -> bool:
    """Does each encode worker process host its GPU's local prefill worker (one process, one event
    loop, both engines)? The one place this is decided: ``plan`` lays pods out by it and the encode
    worker (``workers/main.py``) builds the in-process local prefill by it.

    Yes with the torch engine whenever there is local prefill (``offload.ratio < 1``): CUDA runs
    kernels of two processes concurrently only under MPS, so the per-micro-batch green-context
    split between encode and local prefill needs both engines' streams in one process. No with
    the sim engine (nothing shares a device; its layout, which the twin mirrors, stays).
    ``spec.smPartition.localPrefill`` overrides the default (``own-process``: e.g. under MPS, or
    to measure the difference)."""
    where = spec.sm_partition.local_prefill
    if not spec.has_local_prefill or where == LocalPrefillProcess.OWN_PROCESS:
        return False
    return where == LocalPrefillProcess.IN_ENCODE_PROCESS or str(spec.engine.backend) == Backend.TORCH


def _partition_policy(spec: EPDDeploymentSpec) -> str | None:
    """The SM-partition controller's policy on an encode GPU with a local prefill partner."""
    mode = spec.sm_partition.mode
    if not spec.has_local_prefill or mode == PartitionMode.NONE:
        return None
    return "encode-batch-split" if mode == PartitionMode.DYNAMIC else "static"


def _plan_disaggregated(spec: EPDDeploymentSpec, hw: Hardware) -> Topology:
    a = spec.allocation
    s = float(spec.offload.ratio)
    colocated = spec.has_local_prefill
    in_process = local_prefill_in_encode(spec)
    k = hw.local_prefill_tp if colocated and not in_process else 1
    if colocated and a.encode.replicas % k:
        raise SpecError(
            "spec.allocation.encode.replicas",
            f"is {a.encode.replicas}, but spec.offload.ratio={s} < 1 puts a local prefill worker on the encode "
            f"GPUs and the backbone needs TP{k} on {spec.engine.profile}: one local prefill worker spans {k} "
            f"encode GPUs in one pod, so the encode replicas must be a multiple of {k} "
            f"(or set spec.offload.ratio to 1)",
        )
    policy = _partition_policy(spec)
    partitioned = policy is not None
    batcher = f"batcher:{spec.encode.dispatch}"

    # encode pod: frontend, k encode workers (one GPU each), and with local prefill one local
    # prefill worker of TP k sharing those GPUs (or, in_process, inside the encode process, k = 1)
    # plus one partition controller per GPU
    procs: list[Process] = [_frontend()]
    # system ports: 9090 encode-0 (the Service's), 9091 frontend, 9092 local prefill, 9093.. encode-1..
    routes = ("router:deficit", "envelope") if colocated else ("envelope",)
    for i in range(k):
        port = Port("system", SYSTEM_PORT) if i == 0 else Port(f"system-e{i}", SYSTEM_PORT + 2 + i)
        procs.append(
            Process(
                "encode" if k == 1 else f"encode-{i}",
                Stage.ENCODE,
                _worker_argv(Stage.ENCODE),
                gpus=1,
                owns=(i,),
                tp=a.encode.tensor_parallel,
                ports=(port,),
                system_port=port.number,
                probe=port.name,
                partition_gpus=(i,) if partitioned else (),
                shm=colocated,
                policies=(batcher, *routes, *(("batcher:prefill-tokens",) if in_process else ())),
                env=((PARTITION_GPU_ENV, str(i)),) if partitioned else (),
                hosts=(Stage.LOCAL_PREFILL,) if in_process else (),
            )
        )
    gpus = tuple(range(k))
    if colocated and not in_process:
        lp = Port("system-lp", SYSTEM_PORT + 2)
        procs.append(
            Process(
                "local-prefill",
                Stage.LOCAL_PREFILL,
                _worker_argv(Stage.LOCAL_PREFILL),
                shares=gpus,
                tp=k,
                ports=(lp,),
                system_port=lp.number,
                probe=lp.name,
                partition_gpus=gpus if partitioned else (),
                shm=True,
                policies=("batcher:prefill-tokens",),
                env=(
                    *SHARE_GPU_ENV.items(),
                    *(((PARTITION_GPU_ENV, ",".join(map(str, gpus))),) if partitioned else ()),
                ),
            ),
        )
    if colocated and partitioned:
        for i in gpus:
            procs.append(
                Process(
                    "partition-controller" if k == 1 else f"partition-controller-{i}",
                    Stage.PARTITION_CONTROLLER,
                    (
                        "easerve", "partition-controller", "--config", CONFIG_PATH, "--gpu", str(i),
                        *(("--total-sms", str(hw.total_sms)) if hw.total_sms else ()),
                    ),  # fmt: skip
                    shares=(i,),
                    partition_gpus=(i,),
                    shm=True,
                    policies=(f"partition:{policy}",),
                    env=tuple(SHARE_GPU_ENV.items()),
                )
            )
    system_port = Port("system", SYSTEM_PORT)
    encode = Pod(
        Stage.ENCODE,
        a.encode.replicas // k,
        tuple(procs),
        (Port("http", HTTP_PORT), system_port),
        SYSTEM_PORT,
    )

    def single(stage: Stage, tp: int, policies: tuple[str, ...], replicas: int) -> Pod:
        return Pod(
            stage,
            replicas,
            (
                Process(
                    str(stage),
                    stage,
                    _worker_argv(stage),
                    gpus=tp,
                    owns=tuple(range(tp)),
                    tp=tp,
                    ports=(system_port,),
                    system_port=SYSTEM_PORT,
                    probe="system",
                    policies=policies,
                ),
            ),
            (system_port,),
            SYSTEM_PORT,
        )

    prefill = single(Stage.PREFILL, a.prefill.tensor_parallel, ("batcher:prefill-tokens",), a.prefill.replicas)
    decode = single(Stage.DECODE, a.decode.tensor_parallel, ("admission:decode",), a.decode.replicas)
    return Topology(DeploymentMode.DISAGGREGATED, (encode, prefill, decode), local_prefill_tp=k)


def _frontend() -> Process:
    return Process(
        "frontend",
        Stage.FRONTEND,
        _worker_argv(Stage.FRONTEND),
        ports=(Port("http", HTTP_PORT),),
        system_port=SYSTEM_PORT + 1,
        http_port=HTTP_PORT,
        probe="http",
        policies=("picker:least-outstanding",),
    )


def _plan_aggregated(spec: EPDDeploymentSpec) -> Topology:
    """The vLLM-style baseline: one pod per ``spec.aggregated.tensorParallel`` GPUs, each a frontend
    and one aggregated worker (encode, prefill and decode in one engine loop) owning those GPUs.
    The worker serves the encode component's endpoint, so every frontend reaches every worker."""
    agg = spec.aggregated_engine
    tp = agg.tensor_parallel
    system = Port("system", SYSTEM_PORT)
    worker = Process(
        "aggregated",
        Stage.AGGREGATED,
        _worker_argv(Stage.AGGREGATED),
        gpus=tp,
        owns=tuple(range(tp)),
        tp=tp,
        ports=(system,),
        system_port=SYSTEM_PORT,
        probe="system",
        policies=("planner:aggregated",),
    )
    pod = Pod(Stage.AGGREGATED, agg.replicas(spec.gpu_budget), (_frontend(), worker),
              (Port("http", HTTP_PORT), system), SYSTEM_PORT)
    return Topology(DeploymentMode.AGGREGATED, (pod,))


def _plan_omni(spec: EPDDeploymentSpec, hw: Hardware) -> Topology:
    """One pod per GPU: the shared stage (HTTP + scheduler, owns the GPU), the downstream stage and
    the partition controller running the bandwidth throttle, all on that GPU."""
    if spec.omni is None:
        raise SpecError("spec.omni", "is required when spec.mode is omni-colocated")
    worker = ("easerve", "worker", "--config", CONFIG_PATH, "--stage")
    share = tuple(SHARE_GPU_ENV.items())
    http, system = Port("http", HTTP_PORT), Port("system", SYSTEM_PORT)
    down = Port("system-dn", SYSTEM_PORT + 1)
    procs = [
        Process(
            "omni-shared",
            Stage.OMNI_SHARED,
            (*worker, str(Stage.OMNI_SHARED)),
            gpus=1,
            owns=(0,),
            ports=(http, system),
            http_port=HTTP_PORT,
            probe="http",
            shm=True,
            policies=("scheduler:omni", "throttle:bandwidth"),
        ),
        Process(
            "omni-downstream",
            Stage.OMNI_DOWNSTREAM,
            (*worker, str(Stage.OMNI_DOWNSTREAM)),
            shares=(0,),
            ports=(down,),
            system_port=down.number,
            probe=down.name,
            shm=True,
            env=(*share, ("DYN_SYSTEM_PORT", str(down.number))),
        ),
    ]
    if spec.sm_partition.mode != PartitionMode.NONE:
        t = hw.omni_throttle
        argv = ["easerve", "partition-controller", "--config", CONFIG_PATH, "--gpu", "0"]
        if t:  # else a profile not readable here (a ConfigMap): the controller reads it in the pod
            argv += [
                "--policy", "bandwidth-throttle", "--ladder", *(str(int(x)) for x in t["ladder"]),
                "--s-aggr", str(int(t["s_aggr"])), "--b-sat", str(float(t["b_sat"])),
                "--gamma", str(float(t.get("gamma", 0.4))), "--total-sms", str(int(t["total_sms"])),
            ]  # fmt: skip
        procs.append(
            Process(
                "partition-controller",
                Stage.PARTITION_CONTROLLER,
                tuple(argv),
                shares=(0,),
                partition_gpus=(0,),
                shm=True,
                policies=("partition:bandwidth-throttle",),
                env=share,
            )
        )
    pod = Pod(Stage.OMNI, spec.gpu_budget, tuple(procs), (http, system), HTTP_PORT)
    return Topology(DeploymentMode.OMNI_COLOCATED, (pod,))
