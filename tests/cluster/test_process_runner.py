"""The kubelet harness's process runner, on plain pods: env and volumes as a kubelet builds them,
restarts with exit codes, SIGTERM then SIGKILL after the grace period, and no process outliving its
pod, its namespace or the harness itself."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import yaml

from .conftest import PodsCluster, harness_processes


def _wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def _pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": [{"name": "main", "image": "ignored", "command": ["sh", "-c", script], **spec.pop("c", {})}],
                 **spec},
    }


def _apply(c: PodsCluster, ns: str, *objs: dict[str, Any]) -> None:
    r = c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(objs))
    assert r.returncode == 0, r.stderr


def _status(c: PodsCluster, ns: str, name: str) -> dict[str, Any]:
    r = c.kubectl("get", "pod", name, "-n", ns, "-o", "json")
    return dict(json.loads(r.stdout)["status"]) if r.returncode == 0 else {}


def test_env_volumes_downward_api_and_var_expansion(pods_cluster: PodsCluster) -> None:
    c = pods_cluster
    ns = c.namespace("runner")
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"greeting": "hello", "k": "v"}}
    sec = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"token": "s3cret"}}
    script = ('echo "cm=$(cat /run/easerve-harness-test/cfg/greeting) sec=$SECRET ip=$MY_IP name=$MY_NAME x=$EXPANDED gpu=$CUDA_VISIBLE_DEVICES"; '
              'touch /run/easerve-harness-test/scratch/made; ls /run/easerve-harness-test/scratch; exec sleep 300')
    pod = _pod("envs", script, c={
        "env": [
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
            {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "MY_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "EXPANDED", "value": "$(MY_NAME)-x"},
        ],
        "resources": {"limits": {"nvidia.com/gpu": "2"}},
        "volumeMounts": [{"name": "cfg", "mountPath": "/run/easerve-harness-test/cfg"}, {"name": "scratch", "mountPath": "/run/easerve-harness-test/scratch"}],
    }, volumes=[{"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "scratch", "emptyDir": {}}])
    _apply(c, ns, cm, sec, pod)
    st = _wait(lambda: (s := _status(c, ns, "envs")).get("containerStatuses", [{}])[0].get("ready") and s, 60, "ready")
    ip = st["podIP"]
    log = c.runner.log_path(ns, "envs", "main")
    _wait(lambda: "made" in log.read_text(), 30, "the script ran")
    (line,) = [ln for ln in log.read_text().splitlines() if ln.startswith("cm=")]
    assert line.startswith(f"cm=hello sec=s3cret ip={ip} name=envs x=envs-x gpu=")
    gpus = line.split("gpu=")[1].split(",")
    assert len(gpus) == 2  # exactly the requested devices
    c.delete_namespace_and_wait(ns)


def test_crash_restarts_with_exit_code_and_back_off(pods_cluster: PodsCluster) -> None:
    c = pods_cluster
    ns = c.namespace("runner")
    _apply(c, ns, _pod("crash", "echo started; exit 3"))

    def restarted() -> dict[str, Any] | None:
        cs = (_status(c, ns, "crash").get("containerStatuses") or [{}])[0]
        return cs if cs.get("restartCount", 0) >= 2 else None

    cs = _wait(restarted, 60, "two restarts")
    assert cs["lastState"]["terminated"]["exitCode"] == 3
    assert cs["lastState"]["terminated"]["reason"] == "Error"
    assert not cs["ready"]
    assert c.runner.log_path(ns, "crash", "main").read_text().count("started") >= 3
    c.delete_namespace_and_wait(ns)


def test_deletion_sends_sigterm_then_sigkill_after_the_grace_period(pods_cluster: PodsCluster) -> None:
    c = pods_cluster
    ns = c.namespace("runner")
    stubborn = _pod("stubborn", "trap 'echo got TERM' TERM; echo up; while true; do sleep 0.2; done",
                    terminationGracePeriodSeconds=2)
    polite = _pod("polite", "trap 'echo bye; exit 0' TERM; echo up; while true; do sleep 0.2; done",
                  terminationGracePeriodSeconds=30,
                  c={"lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "sleep 0.5"]}}}})
    _apply(c, ns, stubborn, polite)
    for name in ("stubborn", "polite"):
        _wait(lambda name=name: c.runner.pids(ns, name), 60, f"{name} running")
        _wait(lambda name=name: "up" in c.runner.log_path(ns, name, "main").read_text(), 30, f"{name} up")
    pids = {k: v for k, v in c.runner.pids(ns).items()}
    r = c.kubectl("delete", "pod", "stubborn", "polite", "-n", ns, "--wait=true", "--timeout=60s")
    assert r.returncode == 0, r.stderr
    assert "got TERM" in c.runner.log_path(ns, "stubborn", "main").read_text()  # TERM first...
    assert "exited with 137" in c.runner.log_path(ns, "stubborn", "main").read_text()  # ...then KILL
    polite_log = c.runner.log_path(ns, "polite", "main").read_text()
    assert "exited with 0" in polite_log  # TERM was enough
    assert polite_log.index("preStop hook done") < polite_log.index("\nbye\n")  # the hook ran before SIGTERM
    assert not c.runner.pids(ns)
    assert not harness_processes(c.runner.ips.octet, ns)
    assert pids  # they were running
    c.delete_namespace_and_wait(ns)


def test_no_process_outlives_its_namespace_or_the_harness(pods_cluster: PodsCluster) -> None:
    from kubelet_harness import KubeletHarness
    from process_runner import ProcessRunner

    c = pods_cluster
    ns = c.namespace("runner")
    _apply(c, ns, _pod("a", "exec sleep 300"), _pod("b", "exec sleep 300"))
    _wait(lambda: len(c.runner.pids(ns)) == 2, 60, "two pods running")
    c.cluster.delete_namespace(ns)
    _wait(lambda: not harness_processes(c.runner.ips.octet, ns), 60, "processes gone with the namespace")

    # a second harness (its own node, cordoned so the scheduler leaves it alone) stopped with a pod running
    runner = ProcessRunner(root=str(c.work / "pods-x"), gpus=2, ip_octet=(c.runner.ips.octet + 1))
    h = KubeletHarness(c.cluster.kubeconfig, node="easerve-node-x", gpus=2, runner=runner).start()
    try:
        c.kubectl("cordon", "easerve-node-x", check=True)
        ns2 = c.namespace("runner")
        _apply(c, ns2, _pod("solo", "exec sleep 300", nodeName="easerve-node-x"))
        _wait(lambda: runner.pids(ns2), 60, "the pod runs on the second node")
        assert harness_processes(runner.ips.octet, ns2)
    finally:
        h.stop()
    assert not harness_processes(runner.ips.octet)  # nothing orphaned by the harness' stop
    c.kubectl("delete", "pod", "solo", "-n", ns2, "--grace-period=0", "--force")
    c.kubectl("delete", "node", "easerve-node-x")
