"""Pods that really run: a private control plane whose kubelet harness runs every container as a process.

`pods_cluster` (package scope) is a second local control plane, separate from the session's `k8s`
(which marks pods Ready without running anything, for fast control-plane tests). Here:

- the discovery etcd runs beside the control plane (e2e/discovery-etcd.sh), and the operator gets it
  as its operator-wide default (``--discovery-etcd-endpoints``), as the chart does;
- the kubelet harness runs with the ProcessRunner (e2e/process_runner.py): containers are processes,
  readiness comes from the declared probes (probed every 0.5 s here instead of every 5 s, to keep
  CI short), crashes restart after a 1 s back-off;
- the kube-proxy stand-in (e2e/kube_proxy.py) makes Services reachable: ``c.proxy.url(ns, svc, port)``;
- the operator runs as a process (webhook off: validation is tested elsewhere).

Every test that uses it carries the ``k8s`` marker and the ``cluster`` marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.workers.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

SIM_SPEEDUP = "8"
"""The sim engine's latencies divided by this in the test pods (spec.pod.env): the pipeline and its
ratios stay, the wall time shrinks. Token counts do not depend on it."""


OPERATOR_NS_PREFIX = "pods"
"""The fixture's operator watches namespaces ``pods-*`` (kopf glob) only, so an operator that a test
installs with the chart (in another namespace) never competes with it."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "pods_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.k8s)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test on the pods cluster reports the cluster as it found it: each namespace's pods,
    their containers' last log lines, the operator's, and what the kube-proxy stand-in routes
    (``PodsCluster.diagnose``). Why: a failure under load (CI, 2026-12-07: the LLaVA frontend's
    Service reset connections during the discovery-etcd outage, and refused them into the next
    test) left only the client's errors; the run directory is gone by the time anyone reads it."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    pc = getattr(item, "funcargs", {}).get("pods_cluster")
    if rep.when != "call" or not rep.failed or pc is None:
        return
    for ns in pc.cluster.namespaces:
        try:
            rep.sections.append((f"cluster state at the failure: {ns}", pc.diagnose(ns)))
        except Exception as e:  # noqa: BLE001 - the report must not hide the test's own failure
            rep.sections.append((f"cluster state at the failure: {ns}", f"could not be read: {e!r}"))


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


class PodsCluster:
    """The running pieces, plus helpers the tests share."""

    def __init__(self, cluster: Any, operator: subprocess.Popen[bytes], work: Path, argv: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        self.operator = operator
        self.work = work
        self._argv, self._env = argv or [], env or {}
        self._prometheus: str | None = None

    @property
    def prometheus_url(self) -> str:
        """A real Prometheus scraping the pods as the chart's PodMonitor does (started on first use)."""
        if self._prometheus is None:
            self._prometheus = str(self.cluster.start_prometheus())
        return self._prometheus

    def confirm_operator_reconciles(self, timeout: float = 60.0, attempts: int = 2) -> None:
        """Hand out the cluster only once the operator has handled an object in a watched namespace.

        A live health endpoint says kopf started, not that its watchers run: once, in a full CI run,
        the first test's object was never handled by a freshly started operator (its log ended at
        kopf's start-up). A probe EPDDeployment in a fresh ``pods-*`` namespace must get its status
        (``observedGeneration``) within `timeout`; if it does not, the end of the operator's log is
        printed and the operator is restarted, once. The probe is deleted before any test runs."""
        for attempt in range(1, attempts + 1):
            ns = self.namespace()
            name = self.apply_example(REPO / "examples" / "llava-v1.6-34b.yaml", ns, EASERVE_SIM_SPEEDUP=SIM_SPEEDUP)
            deadline = time.monotonic() + timeout
            handled = False
            while time.monotonic() < deadline and not handled:
                handled = bool((self.epd(ns, name).get("status") or {}).get("observedGeneration"))
                if not handled:
                    time.sleep(0.3)
            self.kubectl("delete", "epd", "--all", "-n", ns, "--wait=true", "--timeout=60s")
            self.delete_namespace_and_wait(ns)
            if handled:
                return
            log = self.work / "operator.log"
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            found = self.kubectl("api-resources", "--api-group", "easerve.io", "-o", "name")
            print(f"pods_cluster: the operator did not handle {ns}/{name} in {timeout:.0f} s "
                  f"(attempt {attempt}); restarting it. API discovery of easerve.io: "
                  f"{(found.stdout or found.stderr).strip()!r}. Its log begins:\n" + "\n".join(lines[:30])
                  + "\n...and ends:\n" + "\n".join(lines[-20:]), file=sys.stderr)
            self.kill_operator()
            self.start_operator()
        raise RuntimeError(f"the operator handled no object in {attempts} attempts; see {self.work}")

    def kill_operator(self) -> int:
        """SIGKILL the operator (no cleanup of its own); returns its exit status."""
        self.operator.kill()
        return int(self.operator.wait(20))

    def start_operator(self) -> None:
        """Start the operator again with the same arguments (after ``kill_operator``)."""
        health = self._argv[self._argv.index("--health-port") + 1]
        log = (self.work / "operator.log").open("ab")
        self.operator = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT, env=self._env)
        wait_http(f"http://127.0.0.1:{health}/healthz", 60, self.operator)

    @property
    def harness(self) -> Any:
        return self.cluster.harness

    @property
    def runner(self) -> Any:
        return self.cluster.harness.runner

    @property
    def proxy(self) -> Any:
        return self.cluster.proxy

    def runner_env(self, namespace: str, key: str) -> dict[str, str]:
        """The environment of a running container process, ``key`` = ``ns/pod/container``."""
        pid = self.runner.pids(namespace)[key]
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(e.decode(errors="replace").split("=", 1) for e in raw if b"=" in e)

    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kw)

    def namespace(self, prefix: str = "") -> str:
        """A fresh namespace; watched by the fixture's operator unless `prefix` is given."""
        return str(self.cluster.namespace(prefix or OPERATOR_NS_PREFIX))

    def apply_example(self, path: Path, namespace: str, **env: str) -> str:
        """Apply an example EPDDeployment (with ``spec.pod.env`` added) into `namespace`; returns its name."""
        import yaml

        doc = yaml.safe_load(path.read_text())
        pod = doc["spec"].setdefault("pod", {})
        pod["env"] = [*(pod.get("env") or []), *({"name": k, "value": v} for k, v in env.items())]
        r = self.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        assert r.returncode == 0, r.stderr
        return str(doc["metadata"]["name"])

    def delete_namespace_and_wait(self, namespace: str, timeout: float = 90) -> None:
        """Delete a namespace and wait until the harness has stopped all of its processes."""
        self.cluster.delete_namespace(namespace)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and harness_processes(self.runner.ips.octet, namespace):
            time.sleep(0.3)

    def epd(self, namespace: str, name: str) -> dict[str, Any]:
        r = self.kubectl("get", "epd", name, "-n", namespace, "-o", "json")
        return dict(json.loads(r.stdout or "{}"))

    def wait_ready(self, namespace: str, name: str, timeout: float = 240) -> float:
        """Seconds until the operator reports Ready for the current generation and every pod of the
        deployment is Ready (its processes answering their readiness probes)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        last = ""
        while time.monotonic() < deadline:
            obj = self.epd(namespace, name)
            st = obj.get("status") or {}
            ready = next((c for c in st.get("conditions", []) if c["type"] == "Ready"), {})
            last = f"{st.get('phase')} {st.get('readySummary')} {ready.get('reason')}"
            if (
                ready.get("status") == "True"
                and st.get("observedGeneration") == obj["metadata"]["generation"]
                and self.pods_ready(namespace, name)
            ):
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{namespace}/{name} not Ready in {timeout}s (last: {last})\n{self.diagnose(namespace)}")

    def pods(self, namespace: str, name: str | None = None) -> list[dict[str, Any]]:
        sel = ["-l", f"easerve.io/deployment={name}"] if name else []
        r = self.kubectl("get", "pods", "-n", namespace, *sel, "-o", "json")
        return list(json.loads(r.stdout or '{"items": []}')["items"])

    def pods_ready(self, namespace: str, name: str) -> bool:
        pods = [p for p in self.pods(namespace, name) if not p["metadata"].get("deletionTimestamp")]
        return bool(pods) and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions") or [])
            for p in pods
        )

    def diagnose(self, namespace: str) -> str:
        out = [self.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout]
        for p in self.pods(namespace):
            for c in p["spec"]["containers"]:
                lp = self.runner.log_path(namespace, p["metadata"]["name"], c["name"])
                if lp.exists():
                    lines = lp.read_text(errors="replace").splitlines()
                    tail = [ln for ln in lines if "kube-probe/" not in ln][-12:]  # not the probes' access lines
                    out.append(f"--- {p['metadata']['name']}/{c['name']}\n" + "\n".join(tail))
        op = self.work / "operator.log"
        if op.exists():
            out.append("--- operator\n" + "\n".join(op.read_text(errors="replace").splitlines()[-10:]))
        routes = [f"{svc}:{port} -> {eps or 'no ready endpoint'}{'' if listening else ' (no listener)'}"
                  for svc, port, eps, listening in self.proxy.routes(namespace)]
        out.append("--- kube-proxy stand-in\n" + "\n".join(routes))
        return "\n".join(out)

    def frontend_url(self, namespace: str, name: str, timeout: float = 30.0, stage: str = "encode") -> str:
        """The Service address of ``stage``'s pods (the frontend's: encode, or omni), once the
        kube-proxy stand-in routes it to a ready pod (its endpoint table trails pod readiness by a
        resync, as kube-proxy trails the API)."""
        from easerve_operator.render.stages import stage_name

        svc = stage_name(name, stage)
        url = str(self.proxy.url(namespace, svc, 8000))
        deadline = time.monotonic() + timeout
        while not self.proxy.ready_endpoints(namespace, svc, 8000) and time.monotonic() < deadline:
            time.sleep(0.2)
        return url


@pytest.fixture(autouse=True)
def _reap_test_namespaces(request: pytest.FixtureRequest) -> Iterator[None]:
    """Delete the namespaces a test made and left behind (a test that fails before its own cleanup):
    its pods would keep running and take the 2 CPU cores and the node's GPUs from every later test.
    Namespaces of module fixtures are made before this runs, so they stay for the module."""
    if "pods_cluster" not in request.fixturenames:
        yield
        return
    c: PodsCluster = request.getfixturevalue("pods_cluster")
    before = set(c.cluster.namespaces)
    yield
    for ns in [n for n in c.cluster.namespaces if n not in before]:
        c.kubectl("delete", "epd", "--all", "-n", ns, "--wait=true", "--timeout=60s")  # while the operator runs
        c.delete_namespace_and_wait(ns)


@pytest.fixture(scope="package")
def pods_cluster() -> Iterator[PodsCluster]:
    with running_pods_cluster() as c:
        yield c


def wait_discovered(cluster: Any, timeout: float = 60.0) -> None:
    """Wait until API discovery lists the EPDDeployment resource, not only until the CRD is
    Established: kopf finds the resources it watches through discovery when it starts, and an
    operator started before discovery listed the CRD was seen to handle nothing at all (twice, on
    the first local cluster of a fresh machine; a hypothesis this rules out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = cluster.kubectl("api-resources", "--api-group", "easerve.io", "-o", "name")
        if "epddeployments" in (r.stdout or ""):
            return
        time.sleep(0.5)
    raise TimeoutError(f"API discovery did not list easerve.io/epddeployments within {timeout:.0f} s")


@contextlib.contextmanager
def running_pods_cluster() -> Iterator[PodsCluster]:
    """The fixture's body, usable from a script (``with running_pods_cluster() as c: ...``)."""
    from local_cluster import LocalCluster, start_harness

    run_dir = tempfile.mkdtemp(prefix="easerve-pods-")
    cluster = LocalCluster.start(run_dir, set_env=False, rm_run_dir=not os.environ.get("EASERVE_K8S_KEEP"),
                                 discovery_etcd=True)
    work = Path(run_dir)
    op: subprocess.Popen[bytes] | None = None
    try:
        from easerve_operator.commands.crd import apply_crd

        apply_crd(cluster.kubeconfig)
        wait_discovered(cluster)
        start_harness(cluster, processes=True, root=str(work / "pods"), readiness_period_s=0.5, backoff_s=1.0)
        health = free_port()
        env = {**os.environ, "KUBECONFIG": cluster.kubeconfig, "PYTHONUNBUFFERED": "1",
               "EASERVE_STATE_DIR": str(work / "operator-state")}  # HAS records, per search
        argv = [sys.executable, "-m", "easerve_operator.cli", "operator", "--metrics-port", "0",
                "--namespace", f"{OPERATOR_NS_PREFIX}-*",
                "--health-port", str(health), "--bind", "127.0.0.1",
                "--discovery-etcd-endpoints", str(cluster.discovery_etcd_url)]
        op = subprocess.Popen(argv, stdout=(work / "operator.log").open("wb"), stderr=subprocess.STDOUT, env=env)
        wait_http(f"http://127.0.0.1:{health}/healthz", 60, op)
        pc = PodsCluster(cluster, op, work, argv, env)
        pc.confirm_operator_reconciles()
        yield pc
        op = pc.operator
    finally:
        for ns in list(cluster._namespaces):  # delete while the operator runs (kopf finalizers)
            cluster.kubectl("delete", "epd", "--all", "-n", ns, "--wait=true", "--timeout=60s")
        cluster.cleanup()
        if op is not None:
            op.terminate()
            try:
                op.wait(20)
            except subprocess.TimeoutExpired:
                op.kill()
        cluster.stop(purge=True)


def send_load(url: str, example: Path, n: int, rate: float, seed: int = 0, timeout_s: float = 180.0,
              reqs: list[Any] | None = None) -> list[Any]:
    """``n`` multimodal requests of the example's workload at ``rate``/s, open loop, through ``url``.

    Each request has its own deadline (`timeout_s`): a request that hangs shows up as a
    ``TimeoutError`` outcome instead of stalling the test. Each request opens its own connection
    (``force_close``): a Service balances connections, not requests, so a kept-alive connection
    would stay pinned to a pod after it started terminating (kube-proxy behaves the same).
    Returns the `Outcome`s (record, expected token count, tokens)."""
    import asyncio

    import aiohttp
    from easerve_runtime.api import load_manifest
    from easerve_runtime.bench.load import fetch_model, one_request
    from easerve_runtime.bench.payloads import chat_body
    from easerve_runtime.workload import generate

    _, spec = load_manifest(str(example))
    if reqs is None:  # else: the given requests, at their own arrival times (a step trace, say)
        reqs = generate(spec, rate, n, seed)

    async def main() -> list[Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout) as s:
            model = await fetch_model(s, url)
            bodies = [chat_body(r, model, stream=True) for r in reqs]
            t0 = time.monotonic()
            tasks = []
            for i, r in enumerate(reqs):
                delay = r.arrival_s - (time.monotonic() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one_request(s, url, r, model, t0, bodies[i])))
            return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def harness_processes(octet: int, namespace: str | None = None) -> list[int]:
    """Every process on this machine started by a ProcessRunner with this pod octet (read from
    /proc: the runner's own table could miss a leak), optionally only those of one namespace."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        mine = any(e.startswith(f"EASERVE_HARNESS_POD_IP=127.{octet}.".encode()) for e in env)
        if mine and (namespace is None or any(e.startswith(f"EASERVE_HARNESS_POD={namespace}/".encode()) for e in env)):
            out.append(int(d.name))
    return out
