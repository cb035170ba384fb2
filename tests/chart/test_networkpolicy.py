"""The chart's NetworkPolicy option: the frontend port only from chosen namespaces, worker ports
only pod-to-pod between serving pods. Rendered with helm, then evaluated with the NetworkPolicy
rules (selectors ORed across peers and rules, ports ANDed with peers) for concrete connections.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_cluster import tool

CHART = Path(__file__).resolve().parents[2] / "charts" / "easerve"
STAGE = "easerve.io/stage"


def render(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [tool("helm"), "template", "easerve", str(CHART), "--namespace", "easerve-system", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "NetworkPolicy"]


def _selects(sel: dict[str, Any], labels: dict[str, str]) -> bool:
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def allowed(pol: dict[str, Any], src_ns: str, src_labels: dict[str, str], dst_labels: dict[str, str], port: int) -> bool:
    """Whether ``pol`` admits a TCP connection to a pod with ``dst_labels`` (in the policy's namespace)."""
    spec = pol["spec"]
    if not _selects(spec["podSelector"], dst_labels):
        return True  # not covered by this policy
    own_ns = pol["metadata"]["namespace"]
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        for peer in rule.get("from", []):
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            ns_ok = _selects(ns_sel, {"kubernetes.io/metadata.name": src_ns}) if ns_sel is not None else src_ns == own_ns
            pod_ok = _selects(pod_sel, src_labels) if pod_sel is not None else True
            if ns_ok and pod_ok:
                return True
    return False


def test_disabled_by_default() -> None:
    assert render() == []


@pytest.fixture(scope="module")
def policy() -> list[dict[str, Any]]:
    return render(
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.namespaces={serving,team-b}",
        "--set",
        "networkPolicy.frontendFromNamespaces={gateway}",
        "--set",
        "networkPolicy.metricsFromNamespaces={monitoring}",
    )


def test_one_policy_per_workload_namespace(policy: list[dict[str, Any]]) -> None:
    assert sorted(p["metadata"]["namespace"] for p in policy) == ["serving", "team-b"]
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policy)


def test_frontend_port_only_from_chosen_namespaces(policy: list[dict[str, Any]]) -> None:
    pol = next(p for p in policy if p["metadata"]["namespace"] == "serving")
    encode_pod = {STAGE: "encode", "easerve.io/deployment": "llava"}
    assert allowed(pol, "gateway", {"app": "envoy"}, encode_pod, 8000)
    assert not allowed(pol, "default", {"app": "curl"}, encode_pod, 8000)
    assert not allowed(pol, "gateway", {"app": "envoy"}, encode_pod, 9090)  # not the worker ports
    assert not allowed(pol, "serving", {"app": "curl"}, encode_pod, 8000)  # same namespace, not chosen


def test_worker_ports_only_pod_to_pod(policy: list[dict[str, Any]]) -> None:
    pol = next(p for p in policy if p["metadata"]["namespace"] == "serving")
    decode_pod = {STAGE: "decode"}
    rpc_port = 41234  # Dynamo's request plane picks its port at start
    assert allowed(pol, "serving", {STAGE: "prefill"}, decode_pod, rpc_port)
    assert not allowed(pol, "serving", {"app": "other"}, decode_pod, rpc_port)
    assert not allowed(pol, "team-b", {STAGE: "prefill"}, decode_pod, rpc_port)  # another namespace's workers
    assert not allowed(pol, "gateway", {"app": "envoy"}, decode_pod, rpc_port)
    assert allowed(pol, "monitoring", {"app": "prometheus"}, decode_pod, 9090)
    assert not allowed(pol, "monitoring", {"app": "prometheus"}, decode_pod, rpc_port)
    assert allowed(pol, "serving", {}, {"app": "not-easerve"}, 5432)  # other pods are not covered


def test_values_schema_refuses_a_bad_namespace() -> None:
    r = subprocess.run(
        [tool("helm"), "template", "x", str(CHART), "--set", "networkPolicy.enabled=true", "--set", "networkPolicy.frontendFromNamespaces={Bad_NS}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert r.returncode != 0 and "frontendFromNamespaces" in r.stderr
