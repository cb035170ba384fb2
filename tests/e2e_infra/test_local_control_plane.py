"""The local control plane and the kubelet harness do what the rest of the suite relies on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
NODE = "easerve-node-0"


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll `fn` until it returns something truthy; fail naming `what` (timeouts only guard hangs)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def deployment(name: str, replicas: int, gpus: int, node: str | None = None) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "example.invalid/none:0",
                "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
            }
        ],
        "terminationGracePeriodSeconds": 30,
    }
    if node:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": pod_spec},
        },
    }


@pytest.fixture
def api(k8s: Any) -> tuple[Any, Any]:
    # KUBECONFIG was set by tests/conftest.py before this import: the default loader finds the cluster.
    from kubernetes import client, config

    config.load_kube_config()
    return client.CoreV1Api(), client.AppsV1Api()


def pods(core: Any, ns: str, app: str) -> list[Any]:
    return list(core.list_namespaced_pod(ns, label_selector=f"app={app}").items)


def is_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def test_control_plane_answers(k8s: Any) -> None:
    assert k8s.api_url.startswith("https://127.0.0.1:")
    assert os.environ["KUBECONFIG"] == k8s.kubeconfig
    r = k8s.kubectl("get", "--raw", "/readyz")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    v = json.loads(k8s.kubectl("version", "-o", "json", check=True).stdout)
    assert v["serverVersion"]["gitVersion"].startswith("v1.")
    sa = k8s.kubectl("get", "serviceaccount", "default", "-n", "default", "-o", "name")
    assert sa.stdout.strip() == "serviceaccount/default"


def test_fake_node_is_ready_with_gpus(k8s: Any) -> None:
    h = k8s.require_harness()
    node = json.loads(k8s.kubectl("get", "node", NODE, "-o", "json", check=True).stdout)
    cap = node["status"]["capacity"]
    assert cap["nvidia.com/gpu"] == str(h.gpus)
    from kubernetes.utils import parse_quantity

    assert parse_quantity(cap["pods"]) == 1000 and parse_quantity(cap["cpu"]) == 64
    assert parse_quantity(cap["memory"]) == 512 * 2**30
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert not node["spec"].get("taints")


def test_deployment_pods_are_scheduled_and_readied(
    k8s: Any, k8s_namespace: str, api: tuple[Any, Any]
) -> None:
    core, apps = api
    k8s.require_harness()
    apps.create_namespaced_deployment(k8s_namespace, deployment("web", replicas=3, gpus=2))
    d = wait_for(
        "3 ready replicas",
        lambda: (x := apps.read_namespaced_deployment("web", k8s_namespace)).status.ready_replicas == 3 and x,
    )
    assert d.status.available_replicas == 3
    ps = pods(core, k8s_namespace, "web")
    assert len(ps) == 3
    for p in ps:
        assert p.spec.node_name == NODE
        assert p.status.phase == "Running" and is_ready(p)
        assert p.status.pod_ip and p.status.container_statuses[0].ready
    assert len({p.status.pod_ip for p in ps}) == 3, "pod IPs must be distinct"
    # a ReplicaSet stands between the Deployment and its pods: the controller-manager is working
    rs = apps.list_namespaced_replica_set(k8s_namespace).items
    assert len(rs) == 1 and rs[0].metadata.owner_references[0].name == "web"


def test_gpu_capacity_is_respected(k8s: Any, k8s_namespace: str, api: tuple[Any, Any]) -> None:
    core, apps = api
    too_big = k8s.require_harness().gpus + 1
    apps.create_namespaced_deployment(k8s_namespace, deployment("greedy", replicas=1, gpus=too_big))

    def unschedulable() -> Any:
        for p in pods(core, k8s_namespace, "greedy"):
            for c in p.status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                    return p, c
        return None

    p, cond = wait_for("the scheduler to refuse the pod", unschedulable)
    assert "nvidia.com/gpu" in cond.message
    assert p.spec.node_name is None and p.status.phase == "Pending"


def test_pause_holds_pods_not_ready_until_resume(k8s: Any, k8s_namespace: str, api: tuple[Any, Any]) -> None:
    core, apps = api
    h = k8s.require_harness()
    h.pause()
    try:
        apps.create_namespaced_deployment(k8s_namespace, deployment("held", replicas=2, gpus=1))
        wait_for(
            "2 bound pods",
            lambda: len([p for p in pods(core, k8s_namespace, "held") if p.spec.node_name]) == 2,
        )
        assert h.wait_idle()
        ps = pods(core, k8s_namespace, "held")
        assert not any(is_ready(p) for p in ps), "a paused harness must leave pods not ready"
        d = apps.read_namespaced_deployment("held", k8s_namespace)
        assert not d.status.ready_replicas
    finally:
        h.resume()
    wait_for(
        "2 ready replicas after resume",
        lambda: apps.read_namespaced_deployment("held", k8s_namespace).status.ready_replicas == 2,
    )


def test_not_ready_flip_and_graceful_delete(k8s: Any, k8s_namespace: str, api: tuple[Any, Any]) -> None:
    core, apps = api
    h = k8s.require_harness()
    apps.create_namespaced_deployment(k8s_namespace, deployment("flip", replicas=2, gpus=1))
    wait_for(
        "2 ready", lambda: apps.read_namespaced_deployment("flip", k8s_namespace).status.ready_replicas == 2
    )
    victim = pods(core, k8s_namespace, "flip")[0].metadata.name
    h.set_not_ready(k8s_namespace, victim)
    wait_for(
        "1 ready after set_not_ready",
        lambda: apps.read_namespaced_deployment("flip", k8s_namespace).status.ready_replicas == 1,
    )
    h.set_ready(k8s_namespace, victim)
    wait_for(
        "2 ready after set_ready",
        lambda: apps.read_namespaced_deployment("flip", k8s_namespace).status.ready_replicas == 2,
    )
    # a graceful delete of a bound pod completes only when "the kubelet" confirms it
    core.delete_namespaced_pod(victim, k8s_namespace)
    wait_for(
        "the deleted pod to disappear",
        lambda: victim not in {p.metadata.name for p in pods(core, k8s_namespace, "flip")},
    )
    wait_for(
        "the replacement to be ready",
        lambda: apps.read_namespaced_deployment("flip", k8s_namespace).status.ready_replicas == 2,
    )


def test_harness_runs_as_a_process(k8s: Any, k8s_namespace: str, api: tuple[Any, Any]) -> None:
    core, apps = api
    node = "easerve-node-proc"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "e2e" / "kubelet_harness.py"), "--node", node, "--gpus", "2"],
        env=dict(os.environ, KUBECONFIG=k8s.kubeconfig),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "kubelet harness ready" in line, line
        n = core.read_node(node)
        assert n.status.capacity["nvidia.com/gpu"] == "2"
        proc.send_signal(signal.SIGUSR1)  # pause
        apps.create_namespaced_deployment(k8s_namespace, deployment("proc", replicas=1, gpus=2, node=node))
        wait_for(
            "the pod bound to the process harness's node",
            lambda: any(p.spec.node_name == node for p in pods(core, k8s_namespace, "proc")),
        )
        time.sleep(0.5)  # give a (wrongly) unpaused harness the chance to ready it
        assert not any(is_ready(p) for p in pods(core, k8s_namespace, "proc"))
        proc.send_signal(signal.SIGUSR2)  # resume
        wait_for(
            "the process harness to ready its pod",
            lambda: apps.read_namespaced_deployment("proc", k8s_namespace).status.ready_replicas == 1,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        apps.delete_namespaced_deployment("proc", k8s_namespace)
        core.delete_node(node)
    assert proc.returncode == 0
