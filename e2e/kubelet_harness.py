"""A test harness that PLAYS KUBELET for one fake Node of the local control plane.

The local control plane (e2e/k8s-up.sh) has an apiserver, a controller-manager and a scheduler, but no
kubelet: pods get bound to a node and then nothing runs them. This harness fills that gap for tests. It

* registers a Node (capacity cpu 64, memory 512Gi, pods 1000, nvidia.com/gpu N; Ready; no taints), so
  the real kube-scheduler binds pods to it and respects GPU requests;
* watches the pods bound to that node (one watch, not polling lists, so hundreds of pods are quick)
  and marks each one Running and Ready (phase, podIP, Ready/ContainersReady conditions, ready
  containerStatuses), after an optional delay;
* finishes graceful deletions (a bound pod with a deletionTimestamp waits for its kubelet to confirm;
  without this, namespaces and rolling updates hang forever);
* can be paused (new pods stay not ready) and resumed, so tests can watch a workload move from
  Progressing to Ready; and can flip a single pod to not-ready;
* with a runner that keeps logs (the ProcessRunner), serves the kubelet API's ``/containerLogs``
  (e2e/kubelet_api.py) on the port the Node advertises, so ``kubectl logs`` and the client's
  ``read_namespaced_pod_log`` work as on a real node.

What "running a pod" means is the extension point: a `PodRunner`. The default, `MarkReadyRunner`, runs
nothing and reports the pod ready at once (enough for control-plane tests, and ~100 pods/s). The
`ProcessRunner` (e2e/process_runner.py, ``--run-processes``) starts every container as a local process
and reports container statuses, readiness from the declared probes, restarts and exit codes itself
(a runner with ``reports_status = True``); deletions then wait for its processes to stop (SIGTERM, the
grace period, SIGKILL) before the pod is finalized.

Use it
* from Python: ``h = KubeletHarness(kubeconfig, node="easerve-node-0"); h.start(); ...; h.stop()``
  (``pause()``, ``resume()``, ``set_not_ready(ns, name)``, ``wait_idle()``);
* as a process: ``python e2e/kubelet_harness.py --node easerve-node-0 [--gpus 64] [--delay-ms N]``
  (KUBECONFIG from the environment or ``--kubeconfig``; SIGUSR1 pauses, SIGUSR2 resumes, SIGTERM stops).

It talks to the apiserver with raw JSON (``_preload_content=False``): deserializing every pod into
client models costs more CPU than the whole control plane on a 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

log = logging.getLogger("kubelet_harness")

DEFAULT_NODE = "easerve-node-0"
Pod = dict[str, Any]


class PodRunner(Protocol):
    """What it means to run a pod on the fake node: the seam for running containers as processes."""

    def start(self, pod: Pod) -> str | None:
        """Start the pod's containers; return once they are ready. Return the pod IP, or None to let the
        harness assign one. Raise to leave the pod not ready (the harness logs it and retries later)."""
        ...

    def stop(self, pod: Pod) -> None:
        """Stop whatever `start` started for this pod (called once the pod is deleted or terminating)."""
        ...


def _reports_status(runner: object) -> bool:
    """Whether the runner posts pod status itself (ProcessRunner) instead of the harness marking Ready."""
    return bool(getattr(runner, "reports_status", False))


class MarkReadyRunner:
    """Runs nothing: every pod is reported ready at once. Enough for control-plane tests."""

    def start(self, pod: Pod) -> str | None:
        return None

    def stop(self, pod: Pod) -> None:
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(pod: Pod) -> tuple[str, str]:
    md = pod["metadata"]
    return md["namespace"], md["name"]


def _is_ready(pod: Pod) -> bool:
    for c in pod.get("status", {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


class KubeletHarness:
    """Plays kubelet for one fake Node; see the module docstring."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        node: str = DEFAULT_NODE,
        gpus: int = 64,
        delay_ms: float = 0.0,
        runner: PodRunner | None = None,
        workers: int = 4,
        pod_cidr_prefix: str = "10.244",
        serve_api: bool | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
        self.node = node
        self.gpus = gpus
        self.delay_s = max(0.0, delay_ms) / 1000.0
        self.runner: PodRunner = runner or MarkReadyRunner()
        self.n_workers = workers
        self._ip_prefix = pod_cidr_prefix
        self._ips = itertools.count(2)
        self._lock = threading.Lock()
        self._paused = False
        self._held: dict[str, tuple[str, str]] = {}  # uid -> (ns, name): seen while paused
        self._not_ready: set[tuple[str, str]] = set()  # pods a test forced not-ready
        self._running: dict[str, Pod] = {}  # uid -> pod the runner started
        self._queued: set[str] = set()  # uids waiting in the queue (one entry per pod)
        self._stopping: set[str] = set()  # uids whose processes are being stopped before finalizing
        self._queue: queue.Queue[tuple[float, str, str, str] | None] = queue.Queue()
        self._busy = 0
        self._stop = threading.Event()
        self._synced = threading.Event()
        self._threads: list[threading.Thread] = []
        self._resp: Any = None
        self.readied = 0  # pods marked ready so far (for tests and benchmarks)
        self.finalized = 0  # graceful deletions completed
        self._api: Any = None
        self._core: Any = None
        # the kubelet API (pod logs, e2e/kubelet_api.py): served when the runner keeps logs
        self.serve_api = hasattr(self.runner, "log_path") if serve_api is None else serve_api
        self.kubelet_api: Any = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 30.0) -> KubeletHarness:
        """Register the Node, start watching; returns once the initial pod list is processed."""
        from kubernetes import client, config

        self._api = config.new_client_from_config(config_file=self.kubeconfig)
        self._api.configuration.connection_pool_maxsize = max(8, self.n_workers + 2)
        self._core = client.CoreV1Api(self._api)
        if hasattr(self.runner, "attach"):
            self.runner.attach(self._core, self._patch_status, self.node, self._api.configuration.host)
        if self.serve_api and self.kubelet_api is None:
            from kubelet_api import KubeletApi

            self.kubelet_api = KubeletApi(self._runner_log, self._runner_running).start()
        self._register_node()
        self._stop.clear()
        t = threading.Thread(target=self._watch_loop, name=f"kubelet-harness-watch-{self.node}", daemon=True)
        self._threads = [t]
        for i in range(self.n_workers):
            self._threads.append(
                threading.Thread(target=self._work_loop, name=f"kubelet-harness-{self.node}-{i}", daemon=True)
            )
        for th in self._threads:
            th.start()
        if not self._synced.wait(timeout):
            raise TimeoutError(f"kubelet harness for node {self.node} could not list pods within {timeout}s")
        log.info("kubelet harness up for node %s (%d GPUs)", self.node, self.gpus)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop watching and working, and every process a runner started. The Node object stays (with
    MarkReadyRunner its pods stay bound and Ready)."""
        self._stop.set()
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):  # best effort on a closing socket
                resp.shutdown()  # unblocks the watch thread's read (urllib3 >= 2.3)
        for _ in range(self.n_workers):
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self._threads = []
        self._synced.clear()
        if hasattr(self.runner, "stop_all"):
            self.runner.stop_all()  # no process outlives the harness
        if self.kubelet_api is not None:
            self.kubelet_api.stop()
            self.kubelet_api = None

    def _runner_log(self, namespace: str, pod: str, container: str) -> Any:
        """The log file of a container the runner ran (None: not on this node)."""
        path = self.runner.log_path(namespace, pod, container)  # type: ignore[attr-defined]
        return path if path.exists() else None

    def _runner_running(self, namespace: str, pod: str) -> bool:
        pids = getattr(self.runner, "pids", None)
        return bool(pids(namespace, pod)) if pids is not None else False

    def __enter__(self) -> KubeletHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ test controls
    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """From now on, newly bound pods are held not-ready (already-ready pods stay ready)."""
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        """Ready every pod held while paused, and go back to readying pods as they come."""
        with self._lock:
            self._paused = False
            held, self._held = self._held, {}
        for uid, (ns, name) in held.items():
            self._enqueue(ns, name, uid)

    def set_not_ready(self, namespace: str, name: str) -> None:
        """Flip one pod to not-ready (its container crashed, say) and keep it so until `set_ready`."""
        with self._lock:
            self._not_ready.add((namespace, name))
        self._patch_status(namespace, name, self._status_body(None, ready=False, ip=None))

    def set_ready(self, namespace: str, name: str) -> None:
        """Undo `set_not_ready`: the pod becomes ready again."""
        with self._lock:
            self._not_ready.discard((namespace, name))
        pod = self._get_pod(namespace, name)
        if pod is not None:
            self._enqueue(namespace, name, pod["metadata"]["uid"])

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no pod is queued or being readied (held pods do not count)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = self._queue.empty() and self._busy == 0
            if idle:
                return True
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------ node
    def node_object(self) -> dict[str, Any]:
        capacity = {
            "cpu": "64",
            "memory": "512Gi",
            "pods": "1000",
            "ephemeral-storage": "1Ti",
            "nvidia.com/gpu": str(self.gpus),
        }
        now = _now()
        conds = [
            {
                "type": t,
                "status": "False",
                "reason": f"Kubelet{r}",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for t, r in (
                ("MemoryPressure", "HasSufficientMemory"),
                ("DiskPressure", "HasNoDiskPressure"),
                ("PIDPressure", "HasSufficientPID"),
            )
        ]
        conds.append(
            {
                "type": "Ready",
                "status": "True",
                "reason": "KubeletReady",
                "message": "kubelet harness is posting ready status",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        )
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node,
                "labels": {
                    "kubernetes.io/hostname": self.node,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "easerve.io/kubelet-harness": "true",
                },
            },
            "spec": {"taints": []},
            "status": {
                "capacity": capacity,
                "allocatable": dict(capacity),
                "conditions": conds,
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node},
                ],
                # where the apiserver reaches "the kubelet" for pod logs (k8s-up.sh prefers InternalIP)
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_api.port if self.kubelet_api else 10250}},
                "nodeInfo": {
                    "kubeletVersion": "v1.20.2",
                    "kubeProxyVersion": "v1.20.2",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                    "containerRuntimeVersion": "easerve-kubelet-harness://0",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                    "kernelVersion": "",
                    "osImage": "kubelet harness",
                },
            },
        }

    def _register_node(self) -> None:
        from kubernetes.client.rest import ApiException

        body = self.node_object()
        try:
            self._core.create_node(body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            # an old Node of the same name: take it over
            self._core.patch_node(
                self.node,
                {"metadata": {"labels": body["metadata"]["labels"]}, "spec": {"unschedulable": None}},
                _preload_content=False,
            )
        # status is ignored on create; post it like a kubelet does
        self._core.patch_node_status(self.node, {"status": body["status"]}, _preload_content=False)
        # the apiserver's TaintNodesByCondition admission adds node.kubernetes.io/not-ready:NoSchedule to
        # every new Node; the node-lifecycle controller (not run here) would lift it once Ready.
        self._core.patch_node(self.node, {"spec": {"taints": None}}, _preload_content=False)

    # ------------------------------------------------------------------ watch
    def _list(self) -> str:
        resp = self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}", _preload_content=False
        )
        data = json.loads(resp.data)
        for pod in data.get("items") or []:
            self._on_pod("ADDED", pod)
        rv: str = data["metadata"]["resourceVersion"]
        return rv

    def _events(self, rv: str) -> Iterator[dict[str, Any]]:
        resp = self._core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.node}",
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=300,
            _preload_content=False,
        )
        self._resp = resp
        try:
            buf = b""
            for chunk in resp.stream(amt=None, decode_content=False):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            self._resp = None
            resp.release_conn()

    def _watch_loop(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                    self._synced.set()
                for ev in self._events(rv):
                    typ, obj = ev.get("type"), ev.get("object") or {}
                    if typ == "ERROR":
                        if obj.get("code") == 410:  # resourceVersion too old: list again
                            rv = None
                        break
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    if typ != "BOOKMARK":
                        self._on_pod(str(typ), obj)
            except Exception as e:  # noqa: BLE001 - keep watching through apiserver hiccups
                if self._stop.is_set():
                    return
                log.warning("kubelet harness watch for %s failed (%s); re-listing", self.node, e)
                rv = None
                self._stop.wait(0.5)

    def _on_pod(self, typ: str, pod: Pod) -> None:
        md, st = pod["metadata"], pod.get("status") or {}
        uid = md["uid"]
        ns, name = _key(pod)
        if typ == "DELETED":
            self._forget(uid, pod, grace=0.0)
            return
        if md.get("deletionTimestamp"):
            if _reports_status(self.runner):
                self._stop_then_finalize(uid, pod)
                return
            self._forget(uid, pod)
            self._finalize(ns, name, uid)
            return
        if st.get("phase") in ("Succeeded", "Failed"):
            return
        with self._lock:
            if (ns, name) in self._not_ready:
                return
            if uid in self._running and (_is_ready(pod) or _reports_status(self.runner)):
                return
            if self._paused:
                self._held[uid] = (ns, name)
                return
        self._enqueue(ns, name, uid)

    def _forget(self, uid: str, pod: Pod, grace: float | None = None) -> None:
        with self._lock:
            self._held.pop(uid, None)
            self._not_ready.discard(_key(pod))
            started = self._running.pop(uid, None)
        if started is not None:
            try:
                if grace is not None and _reports_status(self.runner):
                    self.runner.stop(started, grace)  # type: ignore[call-arg]
                else:
                    self.runner.stop(started)
            except Exception as e:  # noqa: BLE001 - a runner failure must not stop the harness
                log.warning("runner.stop failed for %s/%s: %s", *_key(pod), e)

    def _stop_then_finalize(self, uid: str, pod: Pod) -> None:
        """A terminating pod: stop its processes (SIGTERM, grace, SIGKILL) on a thread of its own,
        then confirm the deletion, as a kubelet does. Repeated events for the same pod do nothing."""
        ns, name = _key(pod)
        with self._lock:
            if uid in self._stopping:
                return
            self._stopping.add(uid)

        def work() -> None:
            try:
                self._forget(uid, pod)
                self._finalize(ns, name, uid)
            finally:
                with self._lock:
                    self._stopping.discard(uid)

        threading.Thread(target=work, name=f"kubelet-harness-stop-{ns}/{name}", daemon=True).start()

    # ------------------------------------------------------------------ work
    def _enqueue(self, ns: str, name: str, uid: str, delay_s: float | None = None) -> None:
        with self._lock:
            if uid in self._queued:
                return
            self._queued.add(uid)
        self._queue.put((time.monotonic() + (self.delay_s if delay_s is None else delay_s), ns, name, uid))

    def _work_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._lock:
                self._busy += 1
            try:
                due, ns, name, uid = item
                wait = due - time.monotonic()
                if wait > 0 and self._stop.wait(wait):
                    return
                self._ready_pod(ns, name, uid)
            except Exception as e:  # noqa: BLE001 - log, keep the worker alive, try again later
                log.warning("kubelet harness could not ready %s/%s: %s", item[1], item[2], e)
                with self._lock:
                    self._queued.discard(item[3])
                if not self._stop.is_set():
                    self._enqueue(item[1], item[2], item[3], delay_s=2.0)
            finally:
                with self._lock:
                    self._busy -= 1

    def _ready_pod(self, ns: str, name: str, uid: str) -> None:
        with self._lock:
            self._queued.discard(uid)
            if self._paused:
                self._held[uid] = (ns, name)
                return
            if (ns, name) in self._not_ready:
                return
        pod = self._get_pod(ns, name)
        if pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp"):
            return
        with self._lock:
            started = uid in self._running
        ip = (pod.get("status") or {}).get("podIP")
        if not started:
            ip = self.runner.start(pod) or ip
            with self._lock:
                self._running[uid] = pod
        if _reports_status(self.runner):
            with self._lock:
                self.readied += 1
            return  # the runner posts status (running, ready from probes) itself
        if not ip:
            n = next(self._ips)
            ip = f"{self._ip_prefix}.{n // 250 % 256}.{n % 250 + 2}"
        self._patch_status(ns, name, self._status_body(pod, ready=True, ip=ip))
        with self._lock:
            self.readied += 1

    def _status_body(self, pod: Pod | None, ready: bool, ip: str | None) -> dict[str, Any]:
        now = _now()
        flag = "True" if ready else "False"
        conds = [
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
            {"type": "Ready", "status": flag, "lastTransitionTime": now},
        ]
        status: dict[str, Any] = {"conditions": conds}
        if pod is not None:
            containers = pod["spec"].get("containers") or []
            status.update(
                {
                    "phase": "Running",
                    "hostIP": "127.0.0.1",
                    "startTime": (pod.get("status") or {}).get("startTime") or now,
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "image": c.get("image", ""),
                            "imageID": "",
                            "ready": ready,
                            "restartCount": 0,
                            "started": True,
                            "state": {"running": {"startedAt": now}},
                            "containerID": f"harness://{pod['metadata']['uid']}/{c['name']}",
                        }
                        for c in containers
                    ],
                }
            )
            if ip:
                status["podIP"] = ip
                status["podIPs"] = [{"ip": ip}]
        return {"status": status}

    def _patch_status(self, ns: str, name: str, body: dict[str, Any]) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self._core.patch_namespaced_pod_status(name, ns, body, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    def _get_pod(self, ns: str, name: str) -> Pod | None:
        from kubernetes.client.rest import ApiException

        try:
            resp = self._core.read_namespaced_pod(name, ns, _preload_content=False)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        pod: Pod = json.loads(resp.data)
        return pod

    def _finalize(self, ns: str, name: str, uid: str) -> None:
        """Confirm a graceful deletion, as a kubelet does once the containers are gone."""
        from kubernetes.client.rest import ApiException

        try:
            self._core.delete_namespaced_pod(
                name,
                ns,
                grace_period_seconds=0,
                body={"preconditions": {"uid": uid}, "gracePeriodSeconds": 0},
                _preload_content=False,
            )
            with self._lock:
                self.finalized += 1
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("kubelet harness could not finish deleting %s/%s: %s", ns, name, e.reason)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Play kubelet for a fake Node of the local control plane.")
    p.add_argument("--node", default=DEFAULT_NODE, help="Node name to register (default %(default)s)")
    p.add_argument("--gpus", type=int, default=64, help="nvidia.com/gpu capacity (default %(default)s)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay before a bound pod is marked ready")
    p.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG")
    p.add_argument("--workers", type=int, default=4, help="threads patching pod status (default %(default)s)")
    p.add_argument("--pidfile", default=None, help="write the process id here (e2e/k8s-down.sh stops it)")
    p.add_argument("--run-processes", action="store_true",
                   help="run every container as a local process (e2e/process_runner.py) instead of marking pods Ready")
    p.add_argument("--root", default=None, help="with --run-processes: per-pod folders and logs (default: a temp dir)")
    p.add_argument("--kube-proxy", action="store_true",
                   help="also play kube-proxy: each Service reachable on a loopback address (e2e/kube_proxy.py)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not (args.kubeconfig or os.environ.get("KUBECONFIG")):
        p.error("--kubeconfig or KUBECONFIG is required")
    runner: PodRunner | None = None
    if args.run_processes:
        from process_runner import ProcessRunner

        runner = ProcessRunner(root=args.root, gpus=args.gpus)
    h = KubeletHarness(
        args.kubeconfig, node=args.node, gpus=args.gpus, delay_ms=args.delay_ms, workers=args.workers, runner=runner
    )
    proxy = None
    if args.kube_proxy:
        from kube_proxy import KubeProxy

        proxy = KubeProxy(args.kubeconfig or os.environ["KUBECONFIG"], octet=getattr(runner, "ips", None) and runner.ips.octet)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGUSR1, lambda *_: h.pause())
    signal.signal(signal.SIGUSR2, lambda *_: h.resume())
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(f"{os.getpid()}\n")
    h.start()
    if proxy is not None:
        proxy.start()
    print(
        f"kubelet harness ready: node {args.node}, {args.gpus} GPUs (SIGUSR1 pause, SIGUSR2 resume)",
        flush=True,
    )
    try:
        while not done.wait(1.0):
            pass
    finally:
        if proxy is not None:
            proxy.stop()
        h.stop()
        if args.pidfile:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.pidfile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
