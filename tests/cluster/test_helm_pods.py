"""`helm install` of the chart on the process-running cluster: the operator itself runs as a pod
(its container a process, in-cluster credentials from its ServiceAccount token), then the same
request path as the LLaVA test: example applied, pods Ready, requests through the frontend Service.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from .conftest import REPO, SIM_SPEEDUP, PodsCluster, harness_processes, send_load

CHART = REPO / "charts" / "easerve"
EXAMPLE = REPO / "examples" / "llava-v1.6-34b.yaml"


def test_helm_install_then_requests_through_the_service(pods_cluster: PodsCluster) -> None:
    c = pods_cluster
    ns = c.namespace("helm")  # not watched by the fixture's operator: only the chart's serves it
    etcd = c.cluster.discovery_etcd_url
    r = c.cluster.helm(
        "install", "easerve", str(CHART), "--namespace", ns,
        "--set", "scope=namespace", "--set", f"watchNamespace={ns}",
        "--set", "webhook.enabled=false",  # a cluster-wide webhook would also judge other tests' objects
        "--set", "discovery.etcd.install=false", "--set", f"discovery.etcd.endpoints={etcd}",
    )
    assert r.returncode == 0, r.stderr
    try:
        deadline = time.monotonic() + 120
        op_ready = False
        while time.monotonic() < deadline and not op_ready:
            pods = json.loads(c.kubectl("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=operator",
                                        "-o", "json").stdout)["items"]
            op_ready = any(
                cond["type"] == "Ready" and cond["status"] == "True"
                for p in pods for cond in (p.get("status") or {}).get("conditions") or []
            )
            time.sleep(0.5)
        assert op_ready, c.diagnose(ns)
        op_pod = pods[0]["metadata"]["name"]
        assert f"{ns}/{op_pod}/operator" in c.runner.pids(ns)  # the operator is the chart's pod, a process
        env = c.runner_env(ns, f"{ns}/{op_pod}/operator")
        assert env["EASERVE_DISCOVERY_ETCD_ENDPOINTS"] == etcd

        name = c.apply_example(EXAMPLE, ns, EASERVE_SIM_SPEEDUP=SIM_SPEEDUP)
        c.wait_ready(ns, name, timeout=300)
        out = send_load(c.frontend_url(ns, name), EXAMPLE, n=20, rate=2.0, seed=5)
        errors = [o.record.error for o in out if not o.record.ok]
        assert not errors, Counter(e[:120] for e in errors)
        assert all(o.record.output_tokens == o.expected_tokens for o in out)
        r = c.kubectl("delete", "epd", name, "-n", ns, "--wait=true", "--timeout=120s")
        assert r.returncode == 0, r.stderr
    finally:
        c.kubectl("delete", "epd", "--all", "-n", ns, "--wait=true", "--timeout=60s")
        c.cluster.helm("uninstall", "easerve", "--namespace", ns, "--wait", "--timeout", "120s")
    deadline = time.monotonic() + 120  # the operator's pod has a 30 s grace period to stop in
    while time.monotonic() < deadline and harness_processes(c.runner.ips.octet, ns):
        time.sleep(0.5)
    assert not c.runner.pids(ns)
    assert not harness_processes(c.runner.ips.octet, ns)
