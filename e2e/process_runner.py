"""The kubelet harness's PROCESS RUNNER: runs every container of a pod as a local process (e2e only).

The local control plane has no kubelet and no container runtime. `KubeletHarness` plays the kubelet's
API side (node, pod status, graceful deletion); this runner plays the container runtime and the
kubelet's pod workers, so the pod specs the operator renders are really executed:

* **argv**: ``command + args`` as a kubelet would build them (``$(VAR)`` expanded from the container's
  env). The image is ignored: ``easerve ...`` runs this checkout's CLI with the harness's own Python
  (``python -m easerve_operator.cli``); any other program is looked up on the host's PATH (``etcd``).
* **env**: literal values and ``valueFrom`` (downward API ``fieldRef``: metadata.name/namespace/uid,
  labels, annotations, spec.nodeName, spec.serviceAccountName, status.podIP, status.hostIP;
  ``configMapKeyRef``, ``secretKeyRef``; ``resourceFieldRef`` for limits), plus ``envFrom``, plus
  what a kubelet adds (HOSTNAME, KUBERNETES_SERVICE_HOST/PORT pointing at the local apiserver).
* **volumes**: ConfigMap, Secret, downwardAPI, projected (configMap/secret) volumes are materialised
  (ConfigMap volumes laid out as kubelet's AtomicWriter does, ``..data`` swapped atomically, and kept
  fresh: an updated ConfigMap reaches its pods' files within ``CONFIG_SYNC_S``, as the workers' live
  knobs need)
  to per-pod folders; ``emptyDir`` is a per-pod folder shared by the pod's containers
  (``medium: Memory`` lives under /dev/shm); ``hostPath`` is the host path. Each container runs in
  its own MOUNT NAMESPACE (``unshare --mount``) where those folders are bind-mounted at their
  ``mountPath`` (read-only when asked), so ``/etc/easerve/config.json`` and ``/dev/shm`` mean what
  they mean in the pod. Mount points missing on the host are created as empty directories (as a
  container runtime creates them in its root filesystem). Where mount namespaces are not available
  (not root), paths are rewritten instead: a ``mountPath`` prefix in argv or env values is replaced by
  the folder (``/dev/shm`` users then see the host's /dev/shm; documented, not the default).
* **network**: each pod gets its own loopback address (127.P.x.y) as its pod IP. Processes share the
  host's network namespace, so a wildcard listen would clash across pods; the runner makes every
  container bind its pod IP instead: Python processes get a ``sitecustomize`` (e2e/harness_site/)
  that turns ``bind(("0.0.0.0", port))`` into ``bind((podIP, port))``; Dynamo's Rust listeners get
  ``DYN_SYSTEM_HOST``, ``DYN_TCP_RPC_HOST``, ``DYN_TCP_RESPONSE_STREAM_HOST`` and
  ``DYN_EVENT_PLANE_HOST``; a literal ``0.0.0.0`` in argv is replaced by the pod IP.
* **DNS**: with ``hosts_file`` (kept by the kube-proxy stand-in), each container's ``/etc/hosts`` is that
  file, bind-mounted read-only: ``<service>.<namespace>.svc[.cluster.local]`` resolves to the Service's
  stand-in address, as kube-dns would make it resolve (mount namespaces only).
* **GPUs**: the node advertises ``nvidia.com/gpu``; a container that requests N gets N device indices
  of its own (freed when the pod stops) in ``NVIDIA_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES``; a
  container that requests none gets ``NVIDIA_VISIBLE_DEVICES=void`` and an empty
  ``CUDA_VISIBLE_DEVICES``. Never ``all``.
* **probes**: readiness, liveness and startup from ``httpGet``, ``tcpSocket`` or ``exec``, with their
  period, timeout and thresholds; ``readiness_period_s`` (a harness knob) can probe readiness more
  often than ``periodSeconds`` to keep tests short. A container without a readiness probe is ready
  once running. The pod is Ready when every container is.
* **restarts**: ``restartPolicy`` Always/OnFailure/Never; the first restart is immediate, then a
  back-off of ``backoff_s`` doubling per crash up to 300 s (reset after 10 minutes up), as a kubelet
  does. Container statuses carry restartCount, state (running / waiting CrashLoopBackOff /
  terminated) and lastState.terminated with the exit code (a signal N reads as 128+N).
* **stop**: the ``lifecycle.preStop`` hook (exec or httpGet) if any, SIGTERM to each container's
  process group, the rest of the pod's grace period, then SIGKILL. Every
  container leads its own process group and has PR_SET_PDEATHSIG=SIGKILL towards the supervising
  thread, so no process outlives its pod, its namespace, or the harness (even a harness killed -9).

Logs: ``<root>/<namespace>_<pod>/logs/<container>.log`` (appended across restarts; `log_path`).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime as _dt
import http.client
import json
import logging
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("kubelet_harness.processes")

Pod = dict[str, Any]
E2E = Path(__file__).resolve().parent
SITE_DIR = E2E / "harness_site"
MAX_BACKOFF_S = 300.0
BACKOFF_RESET_S = 600.0
GPU_RESOURCE = "nvidia.com/gpu"
POD_IP_ENV = "EASERVE_HARNESS_POD_IP"
"""Read by e2e/harness_site/sitecustomize.py: the address a wildcard bind is turned into."""
POD_KEY_ENV = "EASERVE_HARNESS_POD"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def mount_namespaces_available() -> bool:
    """Whether `unshare --mount` works here (root with CAP_SYS_ADMIN)."""
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, timeout=10
    )
    return r.returncode == 0


_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """In the child before exec: die with the supervising thread (PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$\(")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known names are replaced, unknown stay, ``$$(`` escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$(":
            return "$("
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, value)


def _quantity(v: Any) -> int:
    try:
        return int(str(v))
    except ValueError:
        return 0


# --------------------------------------------------------------------------- address pools
class AddressPool:
    """Pod IPs on loopback: 127.<octet>.x.y, one per pod, reused after the pod is gone."""

    def __init__(self, octet: int) -> None:
        self.octet = octet
        self._free: list[int] = []
        self._next = 10 * 256 + 2  # 127.P.10.2 upward
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            n = self._free.pop(0) if self._free else self._next
            if n == self._next:
                self._next += 1
                if self._next % 256 in (0, 255):
                    self._next += 3 if self._next % 256 == 255 else 2
        return f"127.{self.octet}.{n // 256}.{n % 256}"

    def give(self, ip: str) -> None:
        parts = ip.split(".")
        with self._lock:
            self._free.append(int(parts[2]) * 256 + int(parts[3]))


class GpuPool:
    """The node's GPU indices; each container gets its own (the device plugin's job)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._owner: dict[int, str] = {}
        self._lock = threading.Lock()

    def take(self, n: int, owner: str) -> list[int]:
        with self._lock:
            free = [i for i in range(self.count) if i not in self._owner]
            if len(free) < n:
                raise RuntimeError(f"{owner}: needs {n} GPUs, {len(free)} of {self.count} free")
            got = free[:n]
            for i in got:
                self._owner[i] = owner
            return got

    def give(self, owner: str) -> None:
        with self._lock:
            for i in [i for i, o in self._owner.items() if o == owner or o.startswith(owner + "/")]:
                del self._owner[i]

    def assigned(self) -> dict[int, str]:
        with self._lock:
            return dict(self._owner)


# --------------------------------------------------------------------------- probes
@dataclass
class Probe:
    kind: str  # http | tcp | exec
    target: Any
    period: float
    timeout: float
    failure_threshold: int
    success_threshold: int
    initial_delay: float

    @classmethod
    def of(cls, spec: dict[str, Any] | None, ports: dict[str, int]) -> Probe | None:
        if not spec:
            return None

        def port(p: Any) -> int:
            return ports[p] if isinstance(p, str) and not p.isdigit() else int(p)

        if "httpGet" in spec:
            g = spec["httpGet"]
            kind, target = "http", (g.get("host"), port(g["port"]), g.get("path", "/"), g.get("scheme", "HTTP"))
        elif "tcpSocket" in spec:
            g = spec["tcpSocket"]
            kind, target = "tcp", (g.get("host"), port(g["port"]))
        elif "exec" in spec:
            kind, target = "exec", list(spec["exec"].get("command") or [])
        else:
            return None
        return cls(
            kind,
            target,
            float(spec.get("periodSeconds", 10)),
            float(spec.get("timeoutSeconds", 1)),
            int(spec.get("failureThreshold", 3)),
            int(spec.get("successThreshold", 1)),
            float(spec.get("initialDelaySeconds", 0)),
        )

    def check(self, ip: str, env: dict[str, str]) -> bool:
        try:
            if self.kind == "http":
                host, port, path, scheme = self.target
                conn_cls = http.client.HTTPSConnection if scheme == "HTTPS" else http.client.HTTPConnection
                kw: dict[str, Any] = {"timeout": self.timeout}
                if scheme == "HTTPS":
                    import ssl

                    kw["context"] = ssl._create_unverified_context()  # kubelet does not verify either
                conn = conn_cls(host or ip, port, **kw)
                try:
                    conn.request("GET", path, headers={"User-Agent": "kube-probe/1.20"})
                    status = conn.getresponse().status
                finally:
                    conn.close()
                return 200 <= status < 400
            if self.kind == "tcp":
                host, port = self.target
                with socket.create_connection((host or ip, port), timeout=self.timeout):
                    return True
            r = subprocess.run(self.target, env=env, capture_output=True, timeout=max(self.timeout, 1.0))
            return r.returncode == 0
        except (OSError, subprocess.SubprocessError, http.client.HTTPException):
            return False


# --------------------------------------------------------------------------- containers
@dataclass
class Container:
    name: str
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    readiness: Probe | None
    liveness: Probe | None
    startup: Probe | None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    started_iso: str = ""
    restarts: int = 0
    ready: bool = False
    started: bool = False  # startup probe passed (or none)
    next_start: float = 0.0
    crashes: int = 0
    ok_streak: int = 0
    fail_streak: int = 0
    live_fail: int = 0
    next_ready_probe: float = 0.0
    next_live_probe: float = 0.0
    last_term: dict[str, Any] | None = None
    done: bool = False  # terminated and not to be restarted (restartPolicy)
    waiting_reason: str = "ContainerCreating"


@dataclass
class PodRun:
    uid: str
    namespace: str
    name: str
    ip: str
    root: Path
    shm_root: Path | None
    grace: float
    restart_policy: str
    containers: list[Container] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    start_iso: str = ""
    last_status: str = ""
    error: str = ""
    config_maps: list[tuple[str, Path, list[dict[str, Any]] | None, int, str]] = field(default_factory=list)
    """ConfigMap volumes to keep fresh: (ConfigMap name, folder, items, mode, resourceVersion written)."""


def _cm_data(obj: dict[str, Any] | None) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in ((obj or {}).get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in ((obj or {}).get("binaryData") or {}).items()})
    return out


def write_atomic(d: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int) -> None:
    """A ConfigMap volume as kubelet's AtomicWriter lays it out: the files in a timestamped folder,
    ``..data`` a symlink to it, each top-level name a symlink through ``..data``. An update writes a
    new folder and swaps ``..data`` with one rename, so a reader sees the old files or the new ones,
    never a mix, and ``os.stat`` of ``config.json`` sees a new inode (the workers' ConfigFollower)."""
    d.mkdir(parents=True, exist_ok=True)
    ts = d / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{time.monotonic_ns()}"
    ProcessRunner._write_items(ts, data, items, mode)
    tmp = d / "..data_tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(ts.name)
    old = os.readlink(d / "..data") if (d / "..data").is_symlink() else None
    os.replace(tmp, d / "..data")
    for top in {p.relative_to(ts).parts[0] for p in ts.rglob("*")}:
        link = d / top
        if not link.is_symlink():
            if link.exists():
                shutil.rmtree(link) if link.is_dir() else link.unlink()
            link.symlink_to(Path("..data") / top)
    if old and old != ts.name:
        shutil.rmtree(d / old, ignore_errors=True)


CONFIG_SYNC_S = 1.0
"""How often the runner re-reads the ConfigMaps its pods mount (kubelet: its sync period plus a
cache TTL, about a minute by default; a second keeps tests short)."""


# --------------------------------------------------------------------------- the runner
class ProcessRunner:
    """A `PodRunner` that runs containers as processes (see the module docstring).

    `KubeletHarness` calls ``attach(core_api, report, node, api_url)`` on start, ``start(pod)`` for each
    pod bound to its node (returns at once with the pod IP; readiness is reported later through
    ``report``), ``stop(pod, grace)`` on deletion and ``stop_all()`` when it stops.
    """

    reports_status = True

    def __init__(
        self,
        root: str | None = None,
        gpus: int = 16,
        readiness_period_s: float | None = None,
        backoff_s: float = 10.0,
        ip_octet: int | None = None,
        mount_namespaces: bool | None = None,
        extra_env: dict[str, str] | None = None,
        tick_s: float = 0.1,
        hosts_file: str | None = None,
    ) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="easerve-pods-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.gpu_pool = GpuPool(gpus)
        self.readiness_period_s = readiness_period_s
        self.backoff_s = backoff_s
        octet = ip_octet if ip_octet is not None else random.randint(10, 90)
        self.ips = AddressPool(octet)
        self.use_mount_ns = mount_namespaces_available() if mount_namespaces is None else mount_namespaces
        self.extra_env = dict(extra_env or {})
        self.tick_s = tick_s
        self.hosts_file = hosts_file  # bound over each container's /etc/hosts (the Service names)
        self.node = "easerve-node-0"
        self.api_host, self.api_port = "127.0.0.1", "443"
        self._core: Any = None
        self._report: Callable[[str, str, dict[str, Any]], None] | None = None
        self._pods: dict[str, PodRun] = {}
        self._lock = threading.Lock()
        self.shm_base = Path("/dev/shm") / f"easerve-harness-{os.getpid()}-{octet}"
        self._refresher: threading.Thread | None = None
        self._closed = threading.Event()

    # ------------------------------------------------------------------ harness side
    def attach(self, core: Any, report: Callable[[str, str, dict[str, Any]], None], node: str, api_url: str) -> None:
        self._core = core
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="configmap-refresh", daemon=True)
            self._refresher.start()
        self._report = report
        self.node = node
        m = re.match(r"https?://([^:/]+)(?::(\d+))?", api_url or "")
        if m:
            self.api_host, self.api_port = m.group(1), m.group(2) or "443"

    def start(self, pod: Pod) -> str | None:
        md = pod["metadata"]
        uid = md["uid"]
        with self._lock:
            run = self._pods.get(uid)
        if run is not None:
            return run.ip
        ip = self.ips.take()
        ns, name = md["namespace"], md["name"]
        spec = pod["spec"]
        root = self.root / f"{ns}_{name}"
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
        (root / "logs").mkdir(parents=True, exist_ok=True)
        run = PodRun(
            uid=uid,
            namespace=ns,
            name=name,
            ip=ip,
            root=root,
            shm_root=None,
            grace=float(spec.get("terminationGracePeriodSeconds", 30)),
            restart_policy=spec.get("restartPolicy", "Always"),
            start_iso=_now(),
        )
        try:
            self._prepare(pod, run)
        except Exception as e:  # noqa: BLE001 - reported on the pod, retried by the harness
            self._cleanup(run)
            self.ips.give(ip)
            raise RuntimeError(f"{ns}/{name}: cannot prepare the pod: {e}") from e
        with self._lock:
            self._pods[uid] = run
        run.thread = threading.Thread(target=self._supervise, args=(run,), name=f"pod-{ns}/{name}", daemon=True)
        run.thread.start()
        return ip

    def stop(self, pod: Pod, grace: float | None = None) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            run = self._pods.pop(uid, None)
        if run is None:
            return
        md = pod["metadata"]
        g = grace
        if g is None:
            g = float(md.get("deletionGracePeriodSeconds") or run.grace)
        self._stop_run(run, g)

    def _refresh_loop(self) -> None:
        """Keep mounted ConfigMaps fresh, as a kubelet does: one list per sync for every pod's volumes."""
        while not self._closed.wait(CONFIG_SYNC_S):
            with self._lock:
                runs = [r for r in self._pods.values() if r.config_maps]
            if not runs:
                continue
            try:
                items = json.loads(self._core.list_config_map_for_all_namespaces(_preload_content=False).data)["items"]
            except Exception as e:  # noqa: BLE001 - the next sync tries again
                log.debug("configmap refresh: %s", e)
                continue
            live = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in items}
            for r in runs:
                for i, (name, d, its, mode, rv) in enumerate(r.config_maps):
                    obj = live.get((r.namespace, name))
                    new_rv = str((obj or {}).get("metadata", {}).get("resourceVersion", ""))
                    if obj is None or new_rv == rv or r.stop.is_set():
                        continue
                    try:
                        write_atomic(d, _cm_data(obj), its, mode)
                    except OSError as e:  # the pod is going away
                        log.debug("configmap refresh of %s/%s: %s", r.namespace, r.name, e)
                        continue
                    r.config_maps[i] = (name, d, its, mode, new_rv)
                    log.info("%s/%s: configmap %s updated in its volume", r.namespace, r.name, name)

    def stop_all(self, grace: float = 5.0) -> None:
        self._closed.set()
        if self._refresher is not None:  # no daemon thread in an API call while the interpreter exits
            self._refresher.join(15)
            self._refresher = None
        with self._lock:
            runs = list(self._pods.values())
            self._pods.clear()
        threads = [threading.Thread(target=self._stop_run, args=(r, grace, False), daemon=True) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(grace + 10)
        shutil.rmtree(self.shm_base, ignore_errors=True)

    # ------------------------------------------------------------------ queries (tests)
    def pods(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(r.namespace, r.name) for r in self._pods.values()]

    def pids(self, namespace: str | None = None, name: str | None = None) -> dict[str, int]:
        """``{"ns/pod/container": pid}`` of the running processes (optionally of one pod)."""
        out: dict[str, int] = {}
        with self._lock:
            runs = list(self._pods.values())
        for r in runs:
            if (namespace and r.namespace != namespace) or (name and r.name != name):
                continue
            for c in r.containers:
                p = c.proc
                if p is not None and p.poll() is None:
                    out[f"{r.namespace}/{r.name}/{c.name}"] = p.pid
        return out

    def pod_ip(self, namespace: str, name: str) -> str | None:
        with self._lock:
            for r in self._pods.values():
                if r.namespace == namespace and r.name == name:
                    return r.ip
        return None

    def log_path(self, namespace: str, name: str, container: str) -> Path:
        return self.root / f"{namespace}_{name}" / "logs" / f"{container}.log"

    # ------------------------------------------------------------------ preparing a pod
    def _read(self, kind: str, ns: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.rest import ApiException

        try:
            if kind == "configmap":
                resp = self._core.read_namespaced_config_map(name, ns, _preload_content=False)
            else:
                resp = self._core.read_namespaced_secret(name, ns, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        obj: dict[str, Any] = json.loads(resp.data)
        return obj

    def _kv(self, kind: str, ns: str, name: str, optional: bool) -> dict[str, bytes]:
        obj = self._read(kind, ns, name)
        if obj is None:
            if optional:
                return {}
            raise RuntimeError(f"{kind} {ns}/{name} not found")
        out: dict[str, bytes] = {}
        if kind == "configmap":
            return _cm_data(obj)
        else:
            out.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
            out.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
        return out

    @staticmethod
    def _write_items(d: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, mode: int) -> None:
        d.mkdir(parents=True, exist_ok=True)
        pairs = [(i["key"], i.get("path", i["key"])) for i in items] if items else [(k, k) for k in data]
        for key, rel in pairs:
            if key not in data:
                continue
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data[key])
            with contextlib.suppress(OSError):
                p.chmod(mode)

    def _field(self, pod: Pod, path: str, ip: str) -> str:
        md = pod["metadata"]
        m = re.match(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return str((md.get(m.group(1)) or {}).get(m.group(2), ""))
        table = {
            "metadata.name": md.get("name", ""),
            "metadata.namespace": md.get("namespace", ""),
            "metadata.uid": md.get("uid", ""),
            "spec.nodeName": pod["spec"].get("nodeName", self.node),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": ip,
            "status.podIPs": ip,
            "status.hostIP": "127.0.0.1",
        }
        if path not in table:
            raise RuntimeError(f"fieldRef {path!r} is not supported by the kubelet harness")
        return str(table[path])

    def _volumes(self, pod: Pod, run: PodRun) -> dict[str, Path]:
        ns = run.namespace
        out: dict[str, Path] = {}
        for v in pod["spec"].get("volumes") or []:
            name = v["name"]
            d = run.root / "volumes" / name
            if "configMap" in v:
                c = v["configMap"]
                obj = self._read("configmap", ns, c["name"])
                if obj is None and not c.get("optional"):
                    raise RuntimeError(f"configmap {ns}/{c['name']} not found")
                mode = int(c.get("defaultMode", 0o644))
                write_atomic(d, _cm_data(obj), c.get("items"), mode)
                rv = str(((obj or {}).get("metadata") or {}).get("resourceVersion", ""))
                run.config_maps.append((c["name"], d, c.get("items"), mode, rv))
            elif "secret" in v:
                s = v["secret"]
                data = self._kv("secret", ns, s["secretName"], bool(s.get("optional")))
                self._write_items(d, data, s.get("items"), int(s.get("defaultMode", 0o644)))
            elif "emptyDir" in v:
                if (v["emptyDir"] or {}).get("medium") == "Memory":
                    run.shm_root = self.shm_base / run.uid
                    d = run.shm_root / name
                d.mkdir(parents=True, exist_ok=True)
                d.chmod(0o1777)
            elif "hostPath" in v:
                d = Path(v["hostPath"]["path"])
                if v["hostPath"].get("type") in ("DirectoryOrCreate",):
                    d.mkdir(parents=True, exist_ok=True)
            elif "downwardAPI" in v:
                items = v["downwardAPI"].get("items") or []
                data = {i["path"]: self._field(pod, i["fieldRef"]["fieldPath"], run.ip).encode() for i in items if "fieldRef" in i}
                self._write_items(d, data, None, 0o644)
            elif "projected" in v:
                d.mkdir(parents=True, exist_ok=True)
                for src in v["projected"].get("sources") or []:
                    if "configMap" in src:
                        c = src["configMap"]
                        self._write_items(d, self._kv("configmap", ns, c["name"], bool(c.get("optional"))), c.get("items"), 0o644)
                    elif "secret" in src:
                        s = src["secret"]
                        self._write_items(d, self._kv("secret", ns, s["name"], bool(s.get("optional"))), s.get("items"), 0o644)
                    else:
                        log.warning("%s/%s: projected source %s is not supported; left out", ns, run.name, list(src))
            else:
                log.warning("%s/%s: volume %s of an unsupported type; an empty folder instead", ns, run.name, name)
                d.mkdir(parents=True, exist_ok=True)
            out[name] = d
        return out

    def _container_env(self, pod: Pod, run: PodRun, c: dict[str, Any], gpus: list[int] | None) -> dict[str, str]:
        ns = run.namespace
        venv_bin = str(Path(sys.executable).parent)
        host_path = os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        pythonpath = os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH", "")) if p)
        env: dict[str, str] = {
            "PATH": f"{venv_bin}:{host_path}",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "PYTHONPATH": pythonpath,
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": run.name,
            "KUBERNETES_SERVICE_HOST": self.api_host,
            "KUBERNETES_SERVICE_PORT": self.api_port,
            "KUBERNETES_SERVICE_PORT_HTTPS": self.api_port,
            # the pod network (see the module docstring)
            POD_IP_ENV: run.ip,
            POD_KEY_ENV: f"{run.namespace}/{run.name}",  # lets tests find every process of a pod in /proc
            "DYN_SYSTEM_HOST": run.ip,
            "DYN_TCP_RPC_HOST": run.ip,
            "DYN_TCP_RESPONSE_STREAM_HOST": run.ip,
            "DYN_EVENT_PLANE_HOST": run.ip,
        }
        env.update(self.extra_env)
        for ef in c.get("envFrom") or []:
            prefix = ef.get("prefix", "")
            if "configMapRef" in ef:
                r = ef["configMapRef"]
                data = self._kv("configmap", ns, r["name"], bool(r.get("optional")))
            elif "secretRef" in ef:
                r = ef["secretRef"]
                data = self._kv("secret", ns, r["name"], bool(r.get("optional")))
            else:
                continue
            env.update({prefix + k: v.decode(errors="replace") for k, v in data.items()})
        for e in c.get("env") or []:
            name = e["name"]
            if "valueFrom" not in e:
                env[name] = expand(str(e.get("value", "")), env)
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[name] = self._field(pod, vf["fieldRef"]["fieldPath"], run.ip)
            elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
                kind = "configmap" if "configMapKeyRef" in vf else "secret"
                r = vf.get("configMapKeyRef") or vf["secretKeyRef"]
                data = self._kv(kind, ns, r["name"], bool(r.get("optional")))
                if r["key"] in data:
                    env[name] = data[r["key"]].decode(errors="replace")
                elif not r.get("optional"):
                    raise RuntimeError(f"env {name}: key {r['key']!r} not in {kind} {r['name']}")
            elif "resourceFieldRef" in vf:
                res = vf["resourceFieldRef"]["resource"]
                kind, _, rname = res.partition(".")
                env[name] = str(((c.get("resources") or {}).get(kind) or {}).get(rname, "0"))
        if env.get("NVIDIA_VISIBLE_DEVICES") == "all":
            log.warning("%s/%s/%s asks for NVIDIA_VISIBLE_DEVICES=all; it gets its own devices only", ns, run.name, c["name"])
        devices = ",".join(str(i) for i in gpus) if gpus else ""
        env["NVIDIA_VISIBLE_DEVICES"] = devices or "void"
        env["CUDA_VISIBLE_DEVICES"] = devices
        return env

    def _argv(self, c: dict[str, Any], env: dict[str, str], ip: str) -> list[str]:
        argv = [expand(a, env) for a in (c.get("command") or [])] + [expand(a, env) for a in (c.get("args") or [])]
        if not argv:
            raise RuntimeError(f"container {c['name']}: no command or args (the image's entrypoint is unknown here)")
        argv = [ip if a == "0.0.0.0" else a.replace("://0.0.0.0:", f"://{ip}:") for a in argv]
        if argv[0] in ("tini", "/usr/bin/tini", "/tini"):  # the images' PID 1; nothing to reap here
            argv = argv[2:] if len(argv) > 1 and argv[1] == "--" else argv[1:]
        if argv[0] == "easerve":
            return [sys.executable, "-m", "easerve_operator.cli", *argv[1:]]
        exe = shutil.which(argv[0], path=env.get("PATH"))
        if exe is None:
            raise RuntimeError(f"container {c['name']}: {argv[0]!r} not found on the host")
        return [exe, *argv[1:]]

    def _prepare(self, pod: Pod, run: PodRun) -> None:
        vols = self._volumes(pod, run)
        for i, c in enumerate(pod["spec"].get("containers") or []):
            res = c.get("resources") or {}
            n_gpu = _quantity((res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE) or 0)
            gpus = self.gpu_pool.take(n_gpu, f"{run.uid}/{c['name']}") if n_gpu else None
            env = self._container_env(pod, run, c, gpus)
            argv = self._argv(c, env, run.ip)
            mounts = [(vols[m["name"]], m) for m in c.get("volumeMounts") or [] if m["name"] in vols]
            if self.use_mount_ns:
                argv = self._mount_wrapper(mounts, argv, self.hosts_file)
            else:
                argv, env = self._rewrite_paths(mounts, argv, env)
            ports = {p["name"]: int(p["containerPort"]) for p in c.get("ports") or [] if p.get("name")}
            readiness = Probe.of(c.get("readinessProbe"), ports)
            if readiness is not None and self.readiness_period_s is not None:
                readiness.period = min(readiness.period, self.readiness_period_s)
            run.containers.append(
                Container(
                    name=c["name"],
                    spec=c,
                    argv=argv,
                    env=env,
                    log_path=run.root / "logs" / f"{c['name']}.log",
                    readiness=readiness,
                    liveness=Probe.of(c.get("livenessProbe"), ports),
                    startup=Probe.of(c.get("startupProbe"), ports),
                    next_start=0.0 + i * 0.0,
                )
            )
        if pod["spec"].get("initContainers"):
            log.warning("%s/%s: initContainers are not run by the kubelet harness", run.namespace, run.name)

    @staticmethod
    def _mount_wrapper(
        mounts: list[tuple[Path, dict[str, Any]]], argv: list[str], hosts_file: str | None = None
    ) -> list[str]:
        lines = ["set -e"]
        if hosts_file:  # cluster DNS stand-in: the Service names (e2e/kube_proxy.py), read-only
            lines.append(f"mount --bind {shlex.quote(hosts_file)} /etc/hosts && mount -o remount,bind,ro /etc/hosts")

        def under(path: str, top: str) -> bool:
            top = top.rstrip("/") or "/"
            return path == top or path.startswith(top + "/")

        # a mount whose target covers another mount's source (an emptyDir at /tmp over a harness root
        # in /tmp) goes last, or that source would be hidden; parents before children otherwise
        sources = [str(src) for src, _ in mounts]
        mounts = sorted(
            mounts,
            key=lambda sm: (any(under(x, sm[1]["mountPath"]) for x in sources), sm[1]["mountPath"].count("/")),
        )
        # host paths the process itself needs (this checkout, its editable install, the harness's
        # sitecustomize, PYTHONPATH): a volume mounted over them (an emptyDir at /tmp over a
        # checkout in /tmp) would hide them, so they are stashed first and bound back last
        keep = [str(Path(__file__).resolve().parents[1]), str(SITE_DIR)]
        keep += [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
        covered = sorted({k for k in keep if os.path.isdir(k) and any(under(k, m["mountPath"]) for _, m in mounts)})
        stash = "/run/easerve-harness-keep"
        for i, k in enumerate(covered):
            lines.append(f"mkdir -p {stash}/{i} && mount --bind {shlex.quote(k)} {stash}/{i}")
        for src, m in mounts:
            dst = m["mountPath"]
            s = src / m["subPath"] if m.get("subPath") else src
            if s.is_dir():
                lines.append(f"mkdir -p {shlex.quote(dst)}")
            else:
                lines.append(f"mkdir -p {shlex.quote(os.path.dirname(dst))}; [ -e {shlex.quote(dst)} ] || : > {shlex.quote(dst)}")
            lines.append(f"mount --bind {shlex.quote(str(s))} {shlex.quote(dst)}")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(dst)}")
        for i, k in enumerate(covered):
            lines.append(f"mkdir -p {shlex.quote(k)} && mount --bind {stash}/{i} {shlex.quote(k)}")
        lines.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", "\n".join(lines), "sh", *argv]

    @staticmethod
    def _rewrite_paths(
        mounts: list[tuple[Path, dict[str, Any]]], argv: list[str], env: dict[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        table = sorted(((m["mountPath"].rstrip("/"), str(src)) for src, m in mounts), key=lambda t: -len(t[0]))

        def rw(s: str) -> str:
            for mp, real in table:
                if s == mp or s.startswith(mp + "/"):
                    return real + s[len(mp):]
            return s

        return [rw(a) for a in argv], {k: rw(v) for k, v in env.items()}

    # ------------------------------------------------------------------ running a pod
    def _spawn(self, run: PodRun, c: Container) -> None:
        c.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(c.log_path, "ab") as out:
            cmd = shlex.join(c.argv[-12:]).replace("\n", "\\n")  # one line: the mount wrapper is a script
            out.write(f"--- {_now()} start (restart {c.restarts}): {cmd}\n".encode())
            out.flush()
            c.proc = subprocess.Popen(
                c.argv,
                env=c.env,
                cwd=str(run.root),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_setup,  # noqa: PLW1509 - needed for PR_SET_PDEATHSIG
            )
        now = time.monotonic()
        c.started_at = now
        c.started_iso = _now()
        c.ready = False
        c.started = c.startup is None
        c.ok_streak = c.fail_streak = c.live_fail = 0
        c.next_ready_probe = now + (c.readiness.initial_delay if c.readiness else 0.0)
        c.next_live_probe = now + (c.liveness.initial_delay if c.liveness else 0.0)
        c.waiting_reason = ""

    @staticmethod
    def _signal(c: Container, sig: int) -> None:
        p = c.proc
        if p is None or p.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)

    def _pre_stop(self, run: PodRun, c: Container, grace: float) -> float:
        """Run the container's ``lifecycle.preStop`` hook (exec or httpGet), as a kubelet does before
        SIGTERM, within the grace period; returns the grace left."""
        hook = ((c.spec.get("lifecycle") or {}).get("preStop")) or {}
        if not hook or c.proc is None or c.proc.poll() is not None:
            return grace
        t0 = time.monotonic()
        ports = {p["name"]: int(p["containerPort"]) for p in c.spec.get("ports") or [] if p.get("name")}
        probe = Probe.of({**hook, "timeoutSeconds": max(1.0, grace)}, ports)
        if probe is not None:
            ok = probe.check(run.ip, c.env)
            with contextlib.suppress(OSError), open(c.log_path, "ab") as out:
                out.write(f"--- {_now()} preStop hook {'done' if ok else 'failed'}\n".encode())
        return max(0.0, grace - (time.monotonic() - t0))

    def _kill_container(self, c: Container, grace: float, run: PodRun | None = None) -> None:
        """``run`` given: its preStop hook first (a pod deletion); None: straight to SIGTERM (a
        liveness kill, or the harness itself stopping: a drain pause serves nobody then)."""
        if run is not None:
            grace = self._pre_stop(run, c, grace)
        self._signal(c, signal.SIGTERM)
        p = c.proc
        if p is None:
            return
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self._signal(c, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def _on_exit(self, run: PodRun, c: Container, now: float) -> None:
        p = c.proc
        assert p is not None
        rc = p.returncode
        code = 128 - rc if rc < 0 else rc  # killed by signal N: 128+N, as a container runtime reports
        c.last_term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.started_iso,
            "finishedAt": _now(),
            "containerID": f"harness://{run.uid}/{c.name}",
        }
        if rc < 0:
            c.last_term["signal"] = -rc
        c.proc = None
        c.ready = False
        with open(c.log_path, "ab") as out:
            out.write(f"--- {_now()} exited with {code}\n".encode())
        if run.restart_policy == "Never" or (run.restart_policy == "OnFailure" and code == 0):
            c.done = True
            if all(x.done for x in run.containers):
                # a terminated pod's devices go back (kubelet's device manager reclaims the devices of
                # pods that are no longer active; the scheduler stops counting them too): a finished
                # Job's pod must not keep its GPUs until someone deletes it
                self.gpu_pool.give(run.uid)
            return
        if now - c.started_at >= BACKOFF_RESET_S:
            c.crashes = 0
        delay = 0.0 if c.crashes == 0 else min(MAX_BACKOFF_S, self.backoff_s * 2 ** (c.crashes - 1))
        c.crashes += 1
        c.next_start = now + delay
        c.waiting_reason = "CrashLoopBackOff" if delay > 0 else "ContainerCreating"
        log.info("%s/%s/%s exited with %d; restart in %.0fs", run.namespace, run.name, c.name, code, delay)

    def _tick(self, run: PodRun, c: Container, now: float) -> None:
        if c.done:
            return
        if c.proc is None:
            if now >= c.next_start:
                if c.last_term is not None:
                    c.restarts += 1
                self._spawn(run, c)
            return
        if c.proc.poll() is not None:
            self._on_exit(run, c, now)
            return
        if not c.started and c.startup is not None:
            if now >= c.next_live_probe:
                c.next_live_probe = now + c.startup.period
                if c.startup.check(run.ip, c.env):
                    c.started = True
                else:
                    c.live_fail += 1
                    if c.live_fail >= c.startup.failure_threshold:
                        self._restart_unhealthy(run, c, "startup")
            return
        if c.readiness is None:
            c.ready = True
        elif now >= c.next_ready_probe:
            c.next_ready_probe = now + c.readiness.period
            if c.readiness.check(run.ip, c.env):
                c.fail_streak = 0
                c.ok_streak += 1
                if c.ok_streak >= c.readiness.success_threshold:
                    c.ready = True
            else:
                c.ok_streak = 0
                c.fail_streak += 1
                if c.fail_streak >= c.readiness.failure_threshold or not c.ready:
                    c.ready = False
        if c.liveness is not None and now >= c.next_live_probe:
            c.next_live_probe = now + c.liveness.period
            if c.liveness.check(run.ip, c.env):
                c.live_fail = 0
            else:
                c.live_fail += 1
                if c.live_fail >= c.liveness.failure_threshold:
                    self._restart_unhealthy(run, c, "liveness")

    def _restart_unhealthy(self, run: PodRun, c: Container, which: str) -> None:
        log.warning("%s/%s/%s failed its %s probe; killing it", run.namespace, run.name, c.name, which)
        with open(c.log_path, "ab") as out:
            out.write(f"--- {_now()} {which} probe failed: killing\n".encode())
        self._kill_container(c, run.grace)
        c.live_fail = 0

    def _supervise(self, run: PodRun) -> None:
        try:
            while not run.stop.is_set():
                now = time.monotonic()
                for c in run.containers:
                    if run.stop.is_set():
                        break
                    try:
                        self._tick(run, c, now)
                    except Exception as e:  # noqa: BLE001 - one container's failure is its own
                        run.error = f"{c.name}: {e}"
                        log.warning("%s/%s/%s: %s", run.namespace, run.name, c.name, e)
                        c.proc = None
                        c.done = True
                        c.waiting_reason = "CreateContainerError"
                if not run.stop.is_set():
                    self._post(run)
                run.stop.wait(self.tick_s)
        finally:
            # the stopping side kills the processes; this thread must outlive them (PR_SET_PDEATHSIG)
            run.stop.wait()
            done = getattr(run, "_killed", None)
            if isinstance(done, threading.Event):
                done.wait(run.grace + 15)

    def _stop_run(self, run: PodRun, grace: float, pre_stop: bool = True) -> None:
        killed = threading.Event()
        run._killed = killed  # type: ignore[attr-defined]
        run.stop.set()
        hooks = run if pre_stop else None
        ts = [threading.Thread(target=self._kill_container, args=(c, grace, hooks), daemon=True) for c in run.containers]
        for t in ts:
            t.start()
        for t in ts:
            t.join(grace + 15)
        for c in run.containers:
            p = c.proc
            if p is not None and p.returncode is not None:
                code = 128 - p.returncode if p.returncode < 0 else p.returncode
                with contextlib.suppress(OSError), open(c.log_path, "ab") as out:
                    out.write(f"--- {_now()} stopped: exited with {code}\n".encode())
        killed.set()
        if run.thread is not None:
            run.thread.join(5)
        self._cleanup(run)
        self.ips.give(run.ip)
        log.info("%s/%s stopped", run.namespace, run.name)

    def _cleanup(self, run: PodRun) -> None:
        self.gpu_pool.give(run.uid)
        if run.shm_root is not None:
            shutil.rmtree(run.shm_root, ignore_errors=True)
        shutil.rmtree(run.root / "volumes", ignore_errors=True)

    # ------------------------------------------------------------------ status
    def _container_status(self, run: PodRun, c: Container) -> dict[str, Any]:
        st: dict[str, Any] = {
            "name": c.name,
            "image": c.spec.get("image", ""),
            "imageID": "",
            "containerID": f"harness://{run.uid}/{c.name}",
            "ready": c.ready,
            "restartCount": c.restarts,
            "started": c.proc is not None and c.started,
        }
        if c.proc is not None:
            st["state"] = {"running": {"startedAt": c.started_iso}}
        elif c.done and c.last_term is not None:
            st["state"] = {"terminated": c.last_term}
        else:
            st["state"] = {"waiting": {"reason": c.waiting_reason or "ContainerCreating"}}
        if c.last_term is not None and c.proc is not None or (c.last_term is not None and not c.done):
            st["lastState"] = {"terminated": c.last_term}
        return st

    def _post(self, run: PodRun) -> None:
        statuses = [self._container_status(run, c) for c in run.containers]
        ready = bool(run.containers) and all(c.ready for c in run.containers)
        anyrun = any(c.proc is not None for c in run.containers)
        if all(c.done for c in run.containers) and run.containers:
            ok = all((c.last_term or {}).get("exitCode") == 0 for c in run.containers)
            phase = "Succeeded" if ok else "Failed"
        else:
            phase = "Running" if anyrun else "Pending"
        flag = "True" if ready else "False"
        body = {
            "status": {
                "phase": phase,
                "hostIP": "127.0.0.1",
                "podIP": run.ip,
                "podIPs": [{"ip": run.ip}],
                "startTime": run.start_iso,
                "conditions": [
                    {"type": "Initialized", "status": "True"},
                    {"type": "ContainersReady", "status": flag},
                    {"type": "Ready", "status": flag},
                ],
                "containerStatuses": statuses,
            }
        }
        key = json.dumps(body, sort_keys=True)
        if key == run.last_status or self._report is None:
            return
        now = _now()
        for cond in body["status"]["conditions"]:
            cond["lastTransitionTime"] = now
        try:
            self._report(run.namespace, run.name, body)
            run.last_status = key
        except Exception as e:  # noqa: BLE001 - the apiserver may be briefly away; retried next tick
            log.warning("%s/%s: status not posted: %s", run.namespace, run.name, e)
