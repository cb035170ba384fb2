"""`easerve serve`: one EPDDeployment as local processes (sim engine, file discovery).

One process per container of every pod replica, exactly as the pods run them: the layout is
``easerve_runtime.topology.plan``'s (encode pods with their frontend, encode workers, local
prefill worker and partition controllers; the prefill and decode pods; in omni-colocated mode
the omni pod's shared stage, downstream stage and partition controller). Every process gets its
own Dynamo system port, and all share one file-discovery directory under the work dir, so two
``serve`` runs on a host never see each other's workers.

The launcher writes ``<workdir>/processes.json`` (stage, index, pid, ports, restarts) so tests and
operators can find a given worker (e.g. to kill one), logs the URL once every process is healthy,
and on SIGINT/SIGTERM stops the frontend first (it drains accepted requests), then the workers.

Supervision, as a kubelet would: a process that exits is restarted with exponential back-off
(1 s, 2 s, 4 s ... at most 30 s; the back-off resets once a process stayed up for a minute); the
rest keep serving meanwhile. Stopping has ONE budget (``STOP_GRACE_S``) for all stages together,
after which whatever is left is SIGKILLed, and a second SIGINT/SIGTERM kills at once: ``easerve
serve`` always stops within its drain timeout, whatever state its children are in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from easerve_runtime.api import (
    CONFIG_PATH,
    DeploymentMode,
    EPDDeploymentSpec,
    RuntimeConfig,
    Stage,
    dynamo_namespace,
)
from easerve_runtime.topology import PARTITION_GPU_ENV, SHARED_GPUS_ENV, SINGLE_HOST_FRONTENDS, Hardware
from easerve_runtime.topology import plan as topology_plan
from easerve_runtime.workers.blobs import BLOB_DIR_ENV

log = logging.getLogger("easerve.serve")

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_S = 60.0


@dataclass
class Proc:
    """One process of the topology, placed on this host."""

    stage: str
    index: int
    """Per stage, across pod replicas (encode-0, encode-1, ... over every encode pod)."""
    system_port: int | None
    http_port: int | None = None
    pid: int = 0
    log_path: str = ""
    pod: int = 0
    """Which replica of its pod shape it belongs to (pairs encode workers with their local prefill)."""
    name: str = ""
    """Its container name in the pod."""
    argv: list[str] = field(default_factory=list)
    """The topology's ``easerve ...`` argv (the pod's container args)."""
    partition_gpus: list[int] = field(default_factory=list)
    """Host-unique indices of the partition records it reads or writes."""
    gpus: list[int] = field(default_factory=list)
    """Host GPU indices it runs on (owned, then shared): ``CUDA_VISIBLE_DEVICES`` on a GPU host."""
    restarts: int = 0


_HANDED_OUT: set[int] = set()
"""Every port ``free_port`` has returned in this process (when no ``taken`` set is given)."""


def free_port(lo: int = 20000, hi: int = 32767, taken: set[int] | None = None) -> int:
    """A free TCP port on 127.0.0.1 in [lo, hi], never one already in ``taken``, which it joins.

    Dynamo parses DYN_SYSTEM_PORT as a signed 16-bit integer, so ephemeral ports (>= 32768) are
    rejected; we probe random ports below that instead of asking the kernel for one. A probed port
    is free now but not reserved: two calls before either port is bound could draw the same one
    (a CI run did: one plan, 7 system ports of which 6 distinct). So every port handed out goes in
    ``taken``: by default this process's own set (every caller at once), or a plan's own set.
    """
    taken = _HANDED_OUT if taken is None else taken
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(lo, hi)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            taken.add(port)
            return port
    raise RuntimeError(f"no free port in [{lo}, {hi}]")


START_ORDER = {
    Stage.DECODE: 0,
    Stage.PREFILL: 1,
    Stage.PARTITION_CONTROLLER: 2,
    Stage.LOCAL_PREFILL: 3,
    Stage.OMNI_DOWNSTREAM: 3,
    Stage.ENCODE: 4,
    Stage.AGGREGATED: 4,
    Stage.FRONTEND: 5,
    Stage.OMNI_SHARED: 5,
}
"""Downstream first, so a worker's clients find it; the HTTP front doors last."""
ENTRY = (Stage.FRONTEND, Stage.OMNI_SHARED)
"""The HTTP front doors: stopped first, they drain accepted requests through the rest."""
STOP_ORDER = (
    Stage.AGGREGATED,
    Stage.ENCODE,
    Stage.LOCAL_PREFILL,
    Stage.PREFILL,
    Stage.DECODE,
    Stage.OMNI_DOWNSTREAM,
    Stage.PARTITION_CONTROLLER,
)
"""After the front doors: upstream first, each drains into the next; the controllers last."""


def plan(spec: EPDDeploymentSpec, http_port: int, hardware: Hardware | None = None) -> list[Proc]:
    """The topology's processes placed on this host: workers first and the frontends last.

    Layout is the topology's (``easerve_runtime.topology.plan``), exactly what the pods run:
    one process per container of every pod replica, partition controllers included. Only the
    placement is local: each process gets its own system port; the first frontend gets
    ``http_port`` and any others a free one; partition records get host-unique GPU indices
    (pod replica x GPUs of the pod + the pod-local index).
    """
    topo = topology_plan(spec, hardware)
    procs: list[Proc] = []
    count: dict[str, int] = {}
    taken = {http_port}  # every port this plan hands out, so that no two processes share one
    for pod, replica, p, gpus in topo.placed():
        gpus_per_pod = max(1, pod.node_gpus)
        stage = str(p.stage)
        index = count.get(stage, 0)
        count[stage] = index + 1
        http = None
        if p.http_port is not None:
            http = http_port if stage in ENTRY and index == 0 else free_port(taken=taken)
        procs.append(
            Proc(
                stage,
                index,
                free_port(taken=taken) if p.system_port is not None else None,
                http,
                pod=replica,
                name=p.name,
                argv=list(p.argv),
                partition_gpus=[replica * gpus_per_pod + g for g in p.partition_gpus],
                gpus=list(gpus),
            )
        )
    return sorted(procs, key=lambda p: START_ORDER[Stage(p.stage)])


def command(p: Proc, config_path: str) -> list[str]:
    """The pod's argv for this host: this interpreter, the local config, file discovery, ports."""
    args = [config_path if a == CONFIG_PATH else a for a in p.argv]
    if args[:2] == ["easerve", "worker"]:
        cmd = [sys.executable, "-m", "easerve_runtime.cli.worker", *args[2:]]
        cmd += ["--discovery", "file", "--local-key", f"e{p.pod}"]
        if p.http_port is not None:
            cmd += ["--host", "127.0.0.1", "--port", str(p.http_port)]
        return cmd
    if args[:2] == ["easerve", "partition-controller"]:
        rest = args[2:]
        gpu = rest.index("--gpu")
        rest[gpu + 1] = str(p.partition_gpus[0])
        return [sys.executable, "-c", RUN_PARTITION_CONTROLLER, *rest, "--shm-dir", SHM_DIR_TOKEN]
    raise ValueError(f"{p.name}: no local command for {args[:2]}")


BLOB_SHM_MIN_FREE = 4 << 30
"""A /dev/shm with less free space (a container's default is 64 MiB) cannot hold a few KV caches of
a 7B model (~390 MB each); the workdir's page cache can."""


def blob_dir(workdir: Path) -> Path:
    """Where this run's same-host blobs live (``workers.blobs``): a private directory in
    ``/dev/shm`` (memory) when the host has one with room, else under the workdir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        st = os.statvfs(shm)
        if st.f_bavail * st.f_frsize >= BLOB_SHM_MIN_FREE:
            return Path(tempfile.mkdtemp(prefix="easerve-blobs-", dir=shm))
    d = workdir / "blobs"
    d.mkdir(parents=True, exist_ok=True)
    return d


HOST_GPUS_ENV = "EASERVE_HOST_GPUS"


def count_host_gpus() -> int:
    """GPUs this host has: ``$EASERVE_HOST_GPUS`` if set, else ``nvidia-smi -L`` lines (0 without it)."""
    if (n := os.environ.get(HOST_GPUS_ENV)) is not None:
        return int(n)
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def visible_devices(gpus: list[int], host_gpus: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process placed on ``gpus``: the topology may want more GPUs than
    the host has (a 3-stage deployment on one GPU), then they wrap and processes share a device."""
    return ",".join(dict.fromkeys(str(g % host_gpus) for g in gpus))


MPS_SHARES_ENV = "EASERVE_MPS_SHARES"
"""``stage=percent,...``: under an MPS daemon, the share of the GPU's SMs each stage's processes may
occupy (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). Why: pods that share one GPU time-slice it without
MPS, and under MPS a compute-bound prefill still fills every SM and stalls the memory-bound decode
steps behind it; capping the encode and prefill processes keeps SMs free for decode. Host placement
only (``easerve serve``): in Kubernetes a pod has GPUs of its own, or the device plugin's MPS
sharing sets its limits."""


def mps_shares(text: str | None) -> dict[str, int]:
    """``EASERVE_MPS_SHARES`` parsed: stage name -> percent of SMs; a clear error names what is wrong."""
    out: dict[str, int] = {}
    stages = {str(s) for s in Stage}
    for part in filter(None, (x.strip() for x in (text or "").split(","))):
        stage, sep, pct = part.partition("=")
        if not sep or stage not in stages:
            raise ValueError(f"{MPS_SHARES_ENV}: {part!r} is not stage=percent with a stage in {sorted(stages)}")
        try:
            value = int(pct)
        except ValueError:
            value = 0
        if not 1 <= value <= 100:
            raise ValueError(f"{MPS_SHARES_ENV}: {part!r}: the percent must be an integer in [1, 100]")
        out[stage] = value
    return out


SHM_DIR_TOKEN = "{shm}"
RUN_PARTITION_CONTROLLER = (
    "import argparse, sys; from easerve_runtime.cli import partition_controller as m; "
    "p = argparse.ArgumentParser(prog='easerve partition-controller'); m.add_arguments(p); "
    "sys.exit(m.run(p.parse_args(sys.argv[1:])))"
)


class Launcher:
    def __init__(
        self, name: str, spec: EPDDeploymentSpec, port: int, workdir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.spec = spec
        self.port = port
        self.workdir = workdir
        self.extra_env = env or {}
        self.procs = plan(spec, port)
        self.popen: dict[int, subprocess.Popen[bytes]] = {}
        self._started: dict[int, float] = {}
        self._backoff: dict[int, float] = {}
        self._restart_at: dict[int, float] = {}
        tag = f"{os.getpid()}_{int(time.time())}"
        self.cfg = RuntimeConfig(
            name=name,
            namespace="local",
            dynamo_namespace=dynamo_namespace("local", f"{name}-{tag}"),
            spec=spec,
        )

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg_path = self.workdir / "config.json"
        cfg_path.write_text(self.cfg.to_json())
        kv = self.workdir / "kv"
        kv.mkdir(exist_ok=True)
        shm = self.workdir / "shm"
        shm.mkdir(exist_ok=True)
        self.blob_dir = blob_dir(self.workdir)
        self._cmds: dict[int, tuple[list[str], dict[str, str]]] = {}
        host_gpus = count_host_gpus() if str(self.spec.engine.backend) == "torch" else 0
        shares = mps_shares(self.extra_env.get(MPS_SHARES_ENV, os.environ.get(MPS_SHARES_ENV)))
        wanted = len({g for p in self.procs for g in p.gpus})
        if host_gpus and wanted > host_gpus:
            log.warning("the deployment places %d GPUs on a host with %d: pods share GPUs (index modulo %d)",
                        wanted, host_gpus, host_gpus)
        for i, p in enumerate(self.procs):
            env = dict(os.environ)
            env.update(
                {
                    "DYN_DISCOVERY_BACKEND": "file",
                    "DYN_FILE_KV": str(kv),
                    "DYN_TCP_RPC_HOST": "127.0.0.1",
                    "DYN_SYSTEM_HOST": "127.0.0.1",
                    "PYTHONUNBUFFERED": "1",
                    # the partition records of this run's "GPUs", private to it
                    "EASERVE_PARTITION_SHM": str(shm),
                    "EASERVE_FRONTENDS": str(SINGLE_HOST_FRONTENDS),  # the client reaches one; it admits for all
                    # every process is on this host: big payloads (KV, embeddings) go through memory
                    BLOB_DIR_ENV: str(self.blob_dir),
                }
            )
            if p.system_port is not None:
                env["DYN_SYSTEM_PORT"] = str(p.system_port)
            if p.partition_gpus:
                env[PARTITION_GPU_ENV] = ",".join(map(str, p.partition_gpus))
            if p.gpus and host_gpus:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(p.gpus, host_gpus)
            if host_gpus and wanted > host_gpus:
                env[SHARED_GPUS_ENV] = str(host_gpus)  # the frontend's capacity: pods time-slice these
            env.update(self.extra_env)
            if p.stage in shares:
                env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(shares[p.stage])
            cmd = [str(shm) if a == SHM_DIR_TOKEN else a for a in command(p, str(cfg_path))]
            p.log_path = str(self.workdir / f"{p.stage}-{p.index}.log")
            self._cmds[i] = (cmd, env)
            self._spawn(i)
        self._write_processes()

    def _spawn(self, i: int) -> None:
        cmd, env = self._cmds[i]
        p = self.procs[i]
        with open(p.log_path, "ab") as logf:
            proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        p.pid = proc.pid
        self.popen[i] = proc
        self._started[i] = time.monotonic()

    def _write_processes(self) -> None:
        tmp = self.workdir / "processes.json.tmp"
        tmp.write_text(json.dumps({"url": self.url, "processes": [asdict(p) for p in self.procs]}, indent=1))
        tmp.replace(self.workdir / "processes.json")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self, p: Proc) -> bool:
        """/health answers 200; a process without a health endpoint (a partition controller) is
        healthy while it runs (the caller checks that first)."""
        port = p.http_port if p.http_port is not None else p.system_port
        if port is None:
            return True
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        waiting = list(range(len(self.procs)))
        while waiting:
            for i in list(waiting):
                rc = self.popen[i].poll()
                if rc is not None:
                    p = self.procs[i]
                    tail = Path(p.log_path).read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{p.stage}-{p.index} exited with {rc} while starting:\n{tail}")
                if self._healthy(self.procs[i]):
                    waiting.remove(i)
            if not waiting:
                break
            if time.monotonic() > deadline:
                names = ", ".join(f"{self.procs[i].stage}-{self.procs[i].index}" for i in waiting)
                raise TimeoutError(f"not healthy after {timeout:.0f}s: {names} (logs in {self.workdir})")
            time.sleep(0.2)

    def poll_dead(self, reported: set[int]) -> None:
        """Report processes that exited (once each); no restart (see ``supervise``)."""
        for i, proc in self.popen.items():
            if i not in reported and proc.poll() is not None:
                reported.add(i)
                p = self.procs[i]
                log.warning(
                    "%s-%d (pid %d) exited with %s; log: %s",
                    p.stage,
                    p.index,
                    p.pid,
                    proc.returncode,
                    p.log_path,
                )

    def supervise(self, now: float | None = None) -> None:
        """Restart every exited process after its back-off; call periodically while serving."""
        now = time.monotonic() if now is None else now
        changed = False
        for i, proc in self.popen.items():
            p = self.procs[i]
            if proc.poll() is None:
                if now - self._started.get(i, now) >= BACKOFF_RESET_S:
                    self._backoff.pop(i, None)
                continue
            at = self._restart_at.get(i)
            if at is None:
                delay = self._backoff.get(i, BACKOFF_MIN_S / 2) * 2
                delay = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, delay))
                self._backoff[i] = delay
                self._restart_at[i] = now + delay
                log.warning(
                    "%s-%d (pid %d) exited with %s; restarting in %.0f s (log: %s)",
                    p.stage, p.index, p.pid, proc.returncode, delay, p.log_path,
                )
            elif now >= at:
                del self._restart_at[i]
                self._spawn(i)
                p.restarts += 1
                changed = True
                log.warning("%s-%d restarted as pid %d (restart %d)", p.stage, p.index, p.pid, p.restarts)
        if changed:
            self._write_processes()

    def _signal(self, idx: list[int], sig: int) -> None:
        for i in idx:
            proc = self.popen[i]
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sig)

    def _wait(self, idx: list[int], timeout: float, abort: Any = None) -> list[int]:
        deadline = time.monotonic() + timeout
        left = [i for i in idx if self.popen[i].poll() is None]
        while left and time.monotonic() < deadline and not (abort is not None and abort()):
            time.sleep(0.05)
            left = [i for i in left if self.popen[i].poll() is None]
        return left

    def stop(self, grace: float = STOP_GRACE_S, abort: Any = None) -> None:
        """Frontend first (it drains accepted requests through the workers), then the workers.

        ``grace`` is the budget for all of it; ``abort()`` (a second signal) cuts it short. What
        is still running after that is SIGKILLed, so this always returns within ``grace`` + 5 s.
        """
        deadline = time.monotonic() + grace
        fe = [i for i, p in enumerate(self.procs) if p.stage in ENTRY]
        workers = [i for i, p in enumerate(self.procs) if p.stage not in ENTRY]
        groups = [fe]
        for stage in STOP_ORDER:  # upstream first, each drains into the next
            groups.append([i for i in workers if self.procs[i].stage == stage])
        for idx in groups:
            if abort is not None and abort():
                break
            self._signal(idx, signal.SIGTERM)
            self._wait(idx, max(0.0, deadline - time.monotonic()), abort)
        stragglers = [i for i in self.popen if self.popen[i].poll() is None]
        self._signal(stragglers, signal.SIGKILL)
        self._wait(stragglers, 5.0)
        if getattr(self, "blob_dir", None) is not None:
            shutil.rmtree(self.blob_dir, ignore_errors=True)  # blobs a dead receiver never took


def _layout(spec: EPDDeploymentSpec) -> str:
    if spec.mode == DeploymentMode.DISAGGREGATED:
        return spec.allocation.label()
    if spec.mode == DeploymentMode.AGGREGATED:
        agg = spec.aggregated_engine
        tp = f"(tp{agg.tensor_parallel})" if agg.tensor_parallel > 1 else ""
        return f"{agg.replicas(spec.gpu_budget)}x(E+P+D){tp} aggregated, token budget {agg.token_budget}"
    return f"{spec.gpu_budget}x omni pod"


def serve(path: str, port: int, workdir: str | None = None, env: dict[str, str] | None = None) -> int:
    """Run the deployment in ``path`` until SIGINT/SIGTERM; 0 on a clean stop."""
    from easerve_runtime.api import load_manifest

    name, spec = load_manifest(path)
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"easerve-{name}-"))
    launcher = Launcher(name, spec, port, wd, env)
    signals = 0

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    launcher.start()
    try:
        # torch workers import torch/transformers and load weights before they turn healthy
        launcher.wait_ready(READY_TIMEOUT_S * (5 if str(spec.engine.backend) == "torch" else 1))
    except (RuntimeError, TimeoutError) as exc:
        log.error("%s", exc)
        launcher.stop(grace=5.0)
        return 1
    log.info(
        "EAServe %s (%s, %s) serving at %s/v1/chat/completions (workdir %s)",
        name,
        spec.served_model_name,
        _layout(spec),
        launcher.url,
        wd,
    )
    while not signals:
        launcher.supervise()
        time.sleep(0.2)
    log.info("stopping: draining the frontend, then the workers (a second signal kills at once)")
    launcher.stop(abort=lambda: signals > 1)
    log.info("stopped")
    return 0
