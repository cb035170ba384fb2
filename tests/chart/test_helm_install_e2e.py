"""`helm install` into the local control plane, then the operator runs with the chart's RBAC.

The kubelet harness "runs" the operator's pod (it only marks it Ready), so the real operator runs here
as a process with the arguments the chart renders and the token of the chart's ServiceAccount: what
it can do is exactly what the chart's Role/ClusterRole grant. It must reconcile an example to Ready.
The chart is installed in namespaced mode (a Role in one namespace), the least-privilege setup, with
the webhook off: our API server cannot reach pod IPs (there are no pods, only the harness).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_runtime.workers.launcher import free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "easerve"
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def kjson(k8s: Any, *args: str) -> Any:
    r = k8s.kubectl(*args, "-o", "json")
    return json.loads(r.stdout) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def release(k8s: Any) -> Iterator[tuple[str, str]]:
    ns = k8s.namespace("easerve")
    name = ns  # contains "easerve": the chart's full name is the release name, unique per session
    r = k8s.helm(
        "install",
        name,
        str(CHART),
        "--namespace",
        ns,
        "--set",
        "scope=namespace",
        "--set",
        "webhook.enabled=false",
        "--set",
        "dashboard.enabled=false",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        yield name, ns
    finally:
        k8s.helm("uninstall", name, "--namespace", ns)


def test_crd_is_established(k8s: Any, release: tuple[str, str]) -> None:
    def established() -> bool:
        crd = kjson(k8s, "get", "crd", "epddeployments.easerve.io")
        return bool(crd) and any(
            c["type"] == "Established" and c["status"] == "True" for c in crd["status"].get("conditions", [])
        )

    wait_for("the CRD to be Established", established)


def test_crd_upgrade_path_after_helm_install(k8s: Any, release: tuple[str, str]) -> None:
    """docs/upgrade.md: Helm created the CRD; `easerve crd apply --force-conflicts` takes it over (Helm's
    create owns every field), after which a plain `easerve crd apply` is an idempotent no-op."""
    easerve = [sys.executable, "-m", "easerve_operator.cli", "crd", "apply", "--kubeconfig", k8s.kubeconfig]
    env = {**os.environ, "KUBECONFIG": k8s.kubeconfig}
    r = subprocess.run([*easerve, "--force-conflicts"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    crd = kjson(k8s, "get", "crd", "epddeployments.easerve.io", "--show-managed-fields")
    assert "easerve-crd" in {m.get("manager") for m in crd["metadata"].get("managedFields", [])}
    rv = crd["metadata"]["resourceVersion"]
    r = subprocess.run(easerve, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert kjson(k8s, "get", "crd", "epddeployments.easerve.io")["metadata"]["resourceVersion"] == rv


def test_operator_deployment_and_rbac_exist(k8s: Any, release: tuple[str, str]) -> None:
    name, ns = release
    dep = wait_for(
        "the operator Deployment to be ready (kubelet harness)",
        lambda: (
            (d := kjson(k8s, "get", "deployment", name, "-n", ns))
            and d["status"].get("readyReplicas") == 1
            and d
        ),
    )
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert kjson(k8s, "get", "serviceaccount", name, "-n", ns)
    assert kjson(k8s, "get", "clusterrole", name) and kjson(k8s, "get", "clusterrolebinding", name)
    assert kjson(k8s, "get", "role", name, "-n", ns) and kjson(k8s, "get", "rolebinding", name, "-n", ns)
    sa = f"system:serviceaccount:{ns}:{name}"

    def can(verb: str, resource: str, namespace: str | None = ns) -> bool:
        args = ["auth", "can-i", verb, resource, "--as", sa]
        args += ["-n", namespace] if namespace else []
        return k8s.kubectl(*args).stdout.strip() == "yes"

    assert can("create", "deployments.apps") and can("patch", "epddeployments.easerve.io")
    assert can("patch", "epddeployments.easerve.io/status") and can("list", "pods")
    assert not can("get", "secrets"), "the operator must not read secrets"
    assert not can("create", "deployments.apps", "default"), "namespaced mode reaches one namespace only"
    assert not can("delete", "pods")


def _sa_kubeconfig(k8s: Any, name: str, ns: str, path: Path) -> str:
    """A kubeconfig that authenticates as the chart's ServiceAccount (its 1.20 token Secret)."""
    secret_name = wait_for(
        "the ServiceAccount token Secret",
        lambda: ((kjson(k8s, "get", "serviceaccount", name, "-n", ns) or {}).get("secrets") or [{}])[0].get(
            "name"
        ),
    )
    secret = wait_for(
        "the token",
        lambda: (
            (s := kjson(k8s, "get", "secret", secret_name, "-n", ns)) and s.get("data", {}).get("token") and s
        ),
    )
    token = base64.b64decode(secret["data"]["token"]).decode()
    admin = yaml.safe_load(Path(k8s.kubeconfig).read_text())
    cluster = admin["clusters"][0]["cluster"]
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "operator", "namespace": ns}}],
        "current-context": "c",
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _chart_args(k8s: Any, name: str, ns: str, metrics: int, health: int) -> list[str]:
    """The operator's arguments as the chart renders them, with free loopback ports."""
    dep = kjson(k8s, "get", "deployment", name, "-n", ns)
    args = list(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args[:2] == ["easerve", "operator"]
    out = []
    for a in args[2:]:
        flag = a.split("=", 1)[0]
        out.append(
            {
                "--metrics-port": f"--metrics-port={metrics}",
                "--health-port": f"--health-port={health}",
                "--bind": "--bind=127.0.0.1",
            }.get(flag, a)
        )
    return out


def test_operator_with_chart_rbac_reconciles_an_example(
    k8s: Any, release: tuple[str, str], tmp_path: Path
) -> None:
    name, ns = release
    kubeconfig = _sa_kubeconfig(k8s, name, ns, tmp_path / "sa-kubeconfig")
    metrics, health = free_port(), free_port()
    args = _chart_args(k8s, name, ns, metrics, health)
    assert f"--namespace={ns}" in args
    log = tmp_path / "operator.log"
    env = {**os.environ, "KUBECONFIG": kubeconfig, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "easerve_operator.cli", "operator", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
    )

    def healthy() -> bool:
        assert proc.poll() is None, f"operator exited:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    applied = False
    try:
        wait_for("the operator's /healthz", healthy, timeout=60)
        r = k8s.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
        assert r.returncode == 0, r.stderr
        applied = True
        epd_name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]

        def ready() -> Any:
            obj = kjson(k8s, "get", "epddeployment", epd_name, "-n", ns)
            st = (obj or {}).get("status") or {}
            conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
            if st.get("observedGeneration") == obj["metadata"]["generation"] and conds.get("Ready") == "True":
                return obj
            return None

        try:
            obj = wait_for("the example to be Ready", ready, timeout=60)
        except pytest.fail.Exception:
            status = (kjson(k8s, "get", "epddeployment", epd_name, "-n", ns) or {}).get("status")
            pods = k8s.kubectl("get", "deployments,pods", "-n", ns, "-o", "wide").stdout
            pytest.fail(
                f"not Ready; status={json.dumps(status)}\n{pods}\noperator log:\n{log.read_text()[-3000:]}"
            )
        assert obj["status"]["phase"] == "Ready"
        deps = kjson(k8s, "get", "deployments", "-n", ns, "-l", f"easerve.io/deployment={epd_name}")["items"]
        svcs = kjson(k8s, "get", "services", "-n", ns, "-l", f"easerve.io/deployment={epd_name}")["items"]
        assert {d["metadata"]["labels"]["easerve.io/stage"] for d in deps} >= {"encode", "prefill", "decode"}
        assert len(svcs) >= 3
        forbidden = [line for line in log.read_text().splitlines() if "Forbidden" in line or " 403" in line]
        assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:5])
    finally:
        if applied:  # delete while the operator runs: it holds a finalizer on the object
            k8s.kubectl("delete", "-n", ns, "-f", str(EXAMPLE), "--wait=true", "--timeout=60s")
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_cluster_scope_rbac_reaches_every_namespace_but_no_secrets(k8s: Any) -> None:
    """The default (cluster-wide) install: the ClusterRole grants the operator's verbs everywhere."""
    ns = k8s.namespace("easerve")
    try:
        r = k8s.helm("install", ns, str(CHART), "--namespace", ns, "--set", "dashboard.enabled=false")
        assert r.returncode == 0, r.stdout + r.stderr
        sa = f"system:serviceaccount:{ns}:{ns}"

        def can(verb: str, resource: str, namespace: str) -> bool:
            return (
                k8s.kubectl("auth", "can-i", verb, resource, "--as", sa, "-n", namespace).stdout.strip()
                == "yes"
            )

        for where in ("default", "kube-public"):
            assert can("create", "deployments.apps", where) and can(
                "patch", "epddeployments.easerve.io/status", where
            )
            assert can("list", "pods", where) and can("create", "events", where)
            assert not can("get", "secrets", where) and not can("delete", "pods", where)
        assert (
            k8s.kubectl(
                "auth",
                "can-i",
                "create",
                "validatingwebhookconfigurations.admissionregistration.k8s.io",
                "--as",
                sa,
            ).stdout.strip()
            == "yes"
        ), "the default install has the webhook on"
        assert k8s.kubectl("auth", "can-i", "list", "nodes", "--as", sa).stdout.strip() == "no"
    finally:
        k8s.helm("uninstall", ns, "--namespace", ns)
