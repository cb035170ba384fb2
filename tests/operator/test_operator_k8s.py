"""The operator against a real kube-apiserver, etcd, controller-manager and scheduler.

Everything goes through the real entry points: `kubectl apply`, `easerve operator`, `easerve crd
apply`. The only stand-in is the kubelet harness, which marks scheduled pods Ready.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_runtime.api import Stage, parse_spec
from easerve_runtime.topology import plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = ["llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b"]
STAGES = ("encode", "prefill", "decode")


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 180.0, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def get(k8s: Any, ns: str, *args: str) -> Any:
    r = k8s.kubectl("-n", ns, "get", *args, "-o", "json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def manifest(example: str, **spec_updates: Any) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    for dotted, value in spec_updates.items():
        node = doc["spec"]
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return doc


def apply(k8s: Any, ns: str, doc: dict[str, Any]) -> Any:
    return k8s.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump(doc))


def children(k8s: Any, ns: str, name: str) -> dict[str, list[dict[str, Any]]]:
    sel = f"easerve.io/deployment={name}"
    return {
        kind: (get(k8s, ns, kind, "-l", sel) or {"items": []})["items"]
        for kind in ("deployments", "services", "configmaps")
    }


def complete_children(k8s: Any, ns: str, name: str) -> dict[str, list[dict[str, Any]]] | None:
    kids = children(k8s, ns, name)
    counts = {k: len(v) for k, v in kids.items()}
    return kids if counts == {"deployments": 3, "services": 3, "configmaps": 1} else None


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c  # type: ignore[no-any-return]
    return {}


def dump(k8s: Any, ns: str) -> str:
    """What a human would look at when a wait times out."""
    out = [k8s.kubectl("-n", ns, "get", "epd,deploy,rs,pods", "-o", "wide").stdout]
    for obj in (get(k8s, ns, "epd") or {"items": []})["items"]:
        out.append(yaml.safe_dump({obj["metadata"]["name"]: obj.get("status")}))
    return "\n".join(out)


def wait_ready(k8s: Any, ns: str, name: str, timeout: float = 300) -> None:
    try:
        wait_for(f"{name} Ready", lambda: ready(k8s, ns, name), timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{dump(k8s, ns)}") from None


def ready(k8s: Any, ns: str, name: str) -> bool:
    obj = get(k8s, ns, "epd", name)
    return (
        bool(obj)
        and condition(obj, "Ready").get("status") == "True"
        and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
    )


def test_examples_create_their_children(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    ns = k8s_namespace
    for ex in EXAMPLES:
        r = k8s.kubectl("-n", ns, "apply", "-f", str(REPO / "examples" / f"{ex}.yaml"))
        assert r.returncode == 0, r.stderr
    for ex in EXAMPLES:
        spec = manifest(ex)["spec"]
        topo = plan(parse_spec(spec))  # the layout the pods must have (one local prefill per k encode GPUs)
        kids = wait_for(f"{ex} children", lambda ex=ex: complete_children(k8s, ns, ex))
        for dep in kids["deployments"]:
            pod = topo.pod(Stage(dep["metadata"]["labels"]["easerve.io/stage"]))
            assert dep["spec"]["replicas"] == pod.replicas
            containers = dep["spec"]["template"]["spec"]["containers"]
            gpus = [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in containers]
            assert [g for g in gpus if g] == [str(p.gpus) for p in pod.processes if p.gpus], (ex, pod.stage, gpus)
            assert [c["name"] for c in containers] == [p.name for p in pod.processes]
            owner = dep["metadata"]["ownerReferences"][0]
            assert owner["kind"] == "EPDDeployment" and owner["name"] == ex and owner["controller"] is True
        assert topo.gpus == sum(spec["allocation"][s]["replicas"] * spec["allocation"][s].get("tensorParallel", 1)
                                for s in STAGES)
        encode = topo.pod(Stage.ENCODE)
        names = [p.name for p in encode.processes]
        if spec["offload"]["ratio"] < 1:
            assert "local-prefill" in names and "partition-controller" in names[-1]
        else:
            assert names == ["frontend", "encode"]
        wait_ready(k8s, ns, ex)
        obj = get(k8s, ns, "epd", ex)
        assert obj["status"]["phase"] == "Ready"
        assert obj["status"]["effective"]["batchBound"] == spec["encode"]["batchBound"]
        assert obj["spec"] == yaml.safe_load(yaml.safe_dump(spec)), "the operator must never write spec"


def test_progressing_then_ready_as_pods_become_ready(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    harness = k8s.require_harness()
    ns, name = k8s_namespace, "llava-v1.6-34b"
    harness.pause()
    try:
        assert apply(k8s, ns, manifest(name)).returncode == 0
        obj = wait_for(
            "Progressing",
            lambda: (lambda o: o if o and condition(o, "Progressing").get("status") == "True" else None)(
                get(k8s, ns, "epd", name)
            ),
        )
        assert condition(obj, "Ready")["status"] == "False"
        assert condition(obj, "Ready")["reason"] == "PodsNotReady"
        assert condition(obj, "Reconciling")["status"] == "True"
        assert obj["status"]["phase"] == "Progressing"
    finally:
        harness.resume()
    wait_ready(k8s, ns, name)
    obj = get(k8s, ns, "epd", name)
    assert condition(obj, "Progressing")["status"] == "False"
    assert condition(obj, "Degraded")["status"] == "False"
    # llava-34b needs TP2 on its 48 GB GPUs: one encode pod holds both encode GPUs and their local prefill
    assert obj["status"]["readySummary"] == "1/1,1/1,2/2"
    assert obj["status"]["stages"]["encode"] == {"desired": 1, "ready": 1}


def test_changing_b_updates_config_live_and_a_start_time_field_rolls_only_encode(
    k8s: Any, operator: Any, k8s_namespace: str
) -> None:
    """B is a live knob (``policies.knobs.LIVE_FIELDS``): a new B rewrites the ConfigMap and no
    pod template changes; the SM split's epsilon is read at start, so it rolls encode, and only it."""
    ns, name = k8s_namespace, "llava-v1.6-34b"
    assert apply(k8s, ns, manifest(name)).returncode == 0
    wait_ready(k8s, ns, name)

    def hashes() -> dict[str, str]:
        return {
            d["metadata"]["labels"]["easerve.io/stage"]: d["spec"]["template"]["metadata"]["annotations"][
                "easerve.io/config-hash"
            ]
            for d in children(k8s, ns, name)["deployments"]
        }

    def config_spec() -> dict[str, Any]:
        cm = children(k8s, ns, name)["configmaps"][0]
        return dict(json.loads(cm["data"]["config.json"])["spec"])

    before = hashes()
    assert apply(k8s, ns, manifest(name, encode__batchBound=16)).returncode == 0
    wait_for("ConfigMap with B=16", lambda: int(config_spec()["encode"]["batchBound"]) == 16)
    wait_for("status.effective B=16", lambda: get(k8s, ns, "epd", name)["status"]["effective"]["batchBound"] == 16)
    assert hashes() == before  # taken live: nothing rolls

    assert apply(k8s, ns, manifest(name, encode__batchBound=16, smPartition__epsilon=0.2)).returncode == 0
    wait_for("ConfigMap with epsilon 0.2", lambda: float(config_spec()["smPartition"]["epsilon"]) == 0.2)
    after = wait_for(
        "new encode template", lambda: (lambda h: h if h["encode"] != before["encode"] else None)(hashes())
    )
    assert after["prefill"] == before["prefill"] and after["decode"] == before["decode"]
    wait_ready(k8s, ns, name)


def test_deleted_or_edited_child_is_repaired(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    ns, name = k8s_namespace, "qwen2.5-vl-32b"
    assert apply(k8s, ns, manifest(name)).returncode == 0
    wait_ready(k8s, ns, name)
    dep = next(
        d
        for d in children(k8s, ns, name)["deployments"]
        if d["metadata"]["labels"]["easerve.io/stage"] == "decode"
    )
    dname, uid = dep["metadata"]["name"], dep["metadata"]["uid"]
    assert k8s.kubectl("-n", ns, "delete", "deployment", dname).returncode == 0
    wait_for(
        "recreated Deployment",
        lambda: (get(k8s, ns, "deployment", dname) or {}).get("metadata", {}).get("uid") not in (None, uid),
    )
    assert k8s.kubectl("-n", ns, "scale", "deployment", dname, "--replicas=7").returncode == 0
    wait_for(
        "replicas restored",
        lambda: (get(k8s, ns, "deployment", dname) or {}).get("spec", {}).get("replicas") == 2,
    )
    svc = f"{dname}"
    assert k8s.kubectl("-n", ns, "delete", "service", svc).returncode == 0
    wait_for("recreated Service", lambda: get(k8s, ns, "service", svc) is not None)
    cm = children(k8s, ns, name)["configmaps"][0]
    k8s.kubectl(
        "-n",
        ns,
        "patch",
        "configmap",
        cm["metadata"]["name"],
        "--type",
        "merge",
        "-p",
        json.dumps({"data": {"config.json": "{}"}}),
    )
    wait_for(
        "config restored",
        lambda: (
            get(k8s, ns, "configmap", cm["metadata"]["name"])["data"]["config.json"]
            == cm["data"]["config.json"]
        ),
    )
    assert operator.metric("easerve_operator_repairs_total") >= 4


def test_deleting_the_owner_garbage_collects_children(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    ns, name = k8s_namespace, "ultravox-v0.6-27b"
    assert apply(k8s, ns, manifest(name)).returncode == 0
    wait_for("children", lambda: len(children(k8s, ns, name)["deployments"]) == 3)
    assert k8s.kubectl("-n", ns, "delete", "epd", name, "--wait=true", "--timeout=60s").returncode == 0
    wait_for("children collected", lambda: not any(children(k8s, ns, name).values()), timeout=240)


def test_invalid_spec_is_refused_with_a_field_named_message(
    k8s: Any, operator: Any, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "llava-v1.6-34b"
    r = apply(k8s, ns, manifest(name, gpuBudget=3))
    assert r.returncode != 0
    assert "spec.allocation" in r.stderr and "gpuBudget=3" in r.stderr, r.stderr
    r = apply(
        k8s,
        ns,
        manifest(
            name,
            offload={"ratio": 0.5},
            allocation={
                "encode": {"replicas": 0},
                "prefill": {"replicas": 1, "tensorParallel": 2},
                "decode": {"replicas": 2, "tensorParallel": 2},
            },
        ),
    )
    assert r.returncode != 0 and "spec.allocation.encode.replicas" in r.stderr, r.stderr
    r = apply(
        k8s,
        ns,
        manifest(
            name, slo={"objective": "gold", "tiers": [{"name": "strict", "ttftSeconds": 1, "tpotMs": 50}]}
        ),
    )
    assert r.returncode != 0 and "spec.slo.objective" in r.stderr, r.stderr
    r = apply(k8s, ns, manifest(name, encode__batchBound=0))  # schema-level: the CRD's openAPIV3Schema
    assert r.returncode != 0 and "spec.encode.batchBound" in r.stderr, r.stderr
    assert get(k8s, ns, "epd", name) is None


def test_insufficient_capacity_is_reported(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    k8s.require_harness()
    ns, name = k8s_namespace, "qwen2.5-vl-32b"
    big = {
        "encode": {"replicas": 1},
        "prefill": {"replicas": 1, "tensorParallel": 8},
        "decode": {"replicas": 9, "tensorParallel": 8},
    }  # 81 GPUs; the harness node has 64
    assert apply(k8s, ns, manifest(name, gpuBudget=96, allocation=big)).returncode == 0
    obj = wait_for(
        "InsufficientCapacity",
        lambda: (
            lambda o: o if o and condition(o, "Degraded").get("reason") == "InsufficientCapacity" else None
        )(get(k8s, ns, "epd", name)),
    )
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Stalled")["status"] == "True"
    assert "cannot be scheduled" in condition(obj, "Degraded")["message"]
    assert obj["status"]["phase"] == "Degraded"


def test_reconciler_rejects_invalid_spec_when_webhook_is_absent(
    k8s: Any, operator: Any, k8s_namespace: str
) -> None:
    """Defense in depth: an invalid object that got in (webhook down) creates nothing."""
    ns, name = k8s_namespace, "llava-v1.6-34b"
    operator.stop()
    try:
        # a clean stop removes kopf's webhook configuration, so the API server admits anything schema-valid
        wait_for(
            "webhook removed",
            lambda: (
                not (get(k8s, "default", "validatingwebhookconfiguration", "easerve.io") or {}).get(
                    "webhooks"
                )
            ),
            timeout=30,
        )
        assert apply(k8s, ns, manifest(name, gpuBudget=3)).returncode == 0
    finally:
        operator.start()
    obj = wait_for(
        "InvalidSpec",
        lambda: (lambda o: o if o and condition(o, "Ready").get("reason") == "InvalidSpec" else None)(
            get(k8s, ns, "epd", name)
        ),
    )
    assert "spec.allocation" in condition(obj, "Ready")["message"]
    assert condition(obj, "Stalled")["status"] == "True"
    assert obj["status"]["phase"] == "Failed"
    assert not any(children(k8s, ns, name).values())
    # fixing the spec recovers without recreating the object
    assert apply(k8s, ns, manifest(name)).returncode == 0
    wait_ready(k8s, ns, name)


def test_restart_creates_no_duplicates_and_writes_nothing(
    k8s: Any, operator: Any, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "ultravox-v0.6-27b"
    assert apply(k8s, ns, manifest(name)).returncode == 0
    wait_ready(k8s, ns, name)
    before = {
        k: sorted((o["metadata"]["uid"], o["metadata"]["resourceVersion"]) for o in v)
        for k, v in children(k8s, ns, name).items()
    }
    operator.restart()
    time.sleep(3)  # give the resumed operator time to (wrongly) write anything
    after = {
        k: sorted((o["metadata"]["uid"], o["metadata"]["resourceVersion"]) for o in v)
        for k, v in children(k8s, ns, name).items()
    }
    assert after == before, "a resume with nothing changed must not write any child"
    assert operator.metric("easerve_operator_child_writes_total") == 0
    assert ready(k8s, ns, name)
    obj = get(k8s, ns, "epd", name)
    assert condition(obj, "Ready")["reason"] == "AllStagesReady"


ALL_EXAMPLES = sorted(p.stem for p in (REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", ALL_EXAMPLES)
def test_every_example_applies_and_matches_easerve_render(
    example: str, k8s: Any, operator: Any, k8s_namespace: str
) -> None:
    """Each example (omni too) is admitted, reconciled, and `easerve render` is what the operator applied."""
    import subprocess
    import sys

    ns = k8s_namespace
    r = k8s.kubectl("-n", ns, "apply", "-f", str(REPO / "examples" / f"{example}.yaml"))
    assert r.returncode == 0, r.stderr
    name = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())["metadata"]["name"]
    uid = wait_for("uid", lambda: (get(k8s, ns, "epd", name) or {}).get("metadata", {}).get("uid"))
    r = subprocess.run([sys.executable, "-m", "easerve_operator.cli", "render", "-f",
                        str(REPO / "examples" / f"{example}.yaml"), "-n", ns, "--uid", uid],
                       capture_output=True, text=True, check=True)
    rendered = [d for d in yaml.safe_load_all(r.stdout) if d]
    from easerve_operator.reconcile.drift import drifted

    def live_matches() -> bool:
        kids = children(k8s, ns, name)
        by_name = {(o["kind"], o["metadata"]["name"]): o for v in kids.values() for o in v}
        return len(by_name) == len(rendered) and not any(
            drifted(by_name.get((o["kind"], o["metadata"]["name"])), o) for o in rendered)

    wait_for("children as rendered", live_matches)
    wait_ready(k8s, ns, name)
    # everything the operator wrote survived the API server's pruning (omni's stage included)
    st = get(k8s, ns, "epd", name)["status"]
    stages = {o["metadata"]["labels"]["easerve.io/stage"] for o in rendered if o["kind"] == "Deployment"}
    assert set(st["stages"]) == stages, st["stages"]
    cm = next(o for o in rendered if o["kind"] == "ConfigMap")
    assert st["configHash"] == cm["metadata"]["annotations"]["easerve.io/config-hash"]


def test_tuning_result_goes_to_status_never_spec(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    """HAS runs in the operator (twin trials) and reports in status.tuning; adopting it starts no new search."""
    ns, name = k8s_namespace, "llava-v1.6-34b"
    doc = manifest(name, tuning={"enabled": True, "targetRate": 2.0, "trialBudget": 4, "requestsPerTrial": 100})
    assert apply(k8s, ns, doc).returncode == 0

    def tuned() -> dict[str, Any] | None:
        t = ((get(k8s, ns, "epd", name) or {}).get("status") or {}).get("tuning") or {}
        return t if t.get("state") in ("Succeeded", "Failed") else None

    result = wait_for("tuning result", tuned, timeout=400)
    assert result["state"] == "Succeeded", result
    best = result["best"]
    assert best["allocation"] and best["batchBound"] >= 1 and 0.0 <= best["offloadRatio"] <= 1.0
    assert best["metrics"]["throughput"] > 0 and "moderate" in best["metrics"]["goodput"]
    assert result["stage1"]["kept"] >= 1 and result["nTrials"] >= 1
    obj = get(k8s, ns, "epd", name)
    assert obj["spec"] == yaml.safe_load(yaml.safe_dump(doc["spec"])), "the operator must never write spec"
    # adopt the recommendation in "Git": the searched dimensions change, the fingerprint does not
    adopted = json.loads(json.dumps(doc))
    adopted["spec"]["allocation"] = best["specAllocation"]
    adopted["spec"]["encode"]["batchBound"] = best["batchBound"]
    adopted["spec"]["offload"]["ratio"] = best["offloadRatio"]
    if best["offloadRatio"] >= 1:
        adopted["spec"]["smPartition"]["mode"] = "none"
    r = apply(k8s, ns, adopted)
    assert r.returncode == 0, r.stderr
    wait_ready(k8s, ns, name)
    time.sleep(3)
    again = get(k8s, ns, "epd", name)["status"]["tuning"]
    assert again["fingerprint"] == result["fingerprint"] and again["finishedAt"] == result["finishedAt"]
    assert get(k8s, ns, "epd", name)["status"]["effective"]["allocationLabel"] == best["allocation"]


def test_names_whose_labels_cannot_be_applied_are_refused(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    """A 64-character name would be admitted by the API server (253) but no child could carry it as a
    label: it is refused up front, naming metadata.name; 63 characters work end to end."""
    ns = k8s_namespace
    doc = manifest("ultravox-v0.6-27b")
    doc["metadata"]["name"] = "u" * 64
    r = apply(k8s, ns, doc)
    assert r.returncode != 0 and "metadata.name" in r.stderr, r.stderr
    doc["metadata"]["name"] = "u" * 63
    assert apply(k8s, ns, doc).returncode == 0
    wait_for("children of a 63-character name", lambda: complete_children(k8s, ns, "u" * 63))
    wait_ready(k8s, ns, "u" * 63)


def test_prometheus_url_must_be_http(k8s: Any, operator: Any, k8s_namespace: str) -> None:
    ns, name = k8s_namespace, "llava-v1.6-34b"
    for bad in ("file:///etc/passwd", "gopher://example.com/"):
        r = apply(k8s, ns, manifest(name, observability={"prometheusUrl": bad}))
        assert r.returncode != 0 and "spec.observability.prometheusUrl" in r.stderr, r.stderr
    assert apply(k8s, ns, manifest(name, observability={"prometheusUrl": "http://prometheus:9090"})).returncode == 0
