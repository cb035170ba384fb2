"""Omni-colocated rendering: one pod per GPU with shared, downstream and controller containers."""

from __future__ import annotations

from pathlib import Path

import pytest
from easerve_operator.render.omni import render_omni
from easerve_runtime.api import RuntimeConfig, load_manifest

EXAMPLE = Path(__file__).parents[2] / "examples" / "qwen2.5-omni.yaml"
OWNER = {
    "apiVersion": "easerve.io/v1alpha1",
    "kind": "EPDDeployment",
    "name": "qwen2.5-omni",
    "uid": "u-1",
    "controller": True,
}


def _render(budget: int = 1):  # type: ignore[no-untyped-def]
    name, spec = load_manifest(EXAMPLE)
    spec = spec.model_copy(update={"gpu_budget": budget})
    cfg = RuntimeConfig(name=name, namespace="ns", dynamo_namespace="ns_q", spec=spec).to_json()
    return name, spec, cfg, render_omni(name, "ns", spec, cfg, OWNER)


def test_one_deployment_and_service_with_one_gpu_per_pod() -> None:
    name, _, _, objs = _render(budget=3)
    dep, svc = objs
    assert (dep["kind"], svc["kind"]) == ("Deployment", "Service")
    assert dep["spec"]["replicas"] == 3
    for o in objs:
        assert o["metadata"]["labels"]["easerve.io/deployment"] == name
        assert o["metadata"]["labels"]["easerve.io/stage"] == "omni"
        assert o["metadata"]["ownerReferences"] == [OWNER]
        assert o["metadata"]["namespace"] == "ns"
    tmpl = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pod = tmpl["spec"]
    gpus = [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in pod["containers"]]
    assert gpus == ["1", None, None]  # the GPU is requested once; the others share it


def test_pod_has_three_containers_sharing_dev_shm() -> None:
    _, _, _, (dep, _) = _render()
    pod = dep["spec"]["template"]["spec"]
    by = {c["name"]: c for c in pod["containers"]}
    assert set(by) == {"omni-shared", "omni-downstream", "partition-controller"}
    assert by["omni-shared"]["args"][-4:] == [
        "--config",
        "/etc/easerve/config.json",
        "--stage",
        "omni-shared",
    ]
    assert by["omni-downstream"]["args"][-1] == "omni-downstream"
    assert by["omni-shared"]["args"][:2] == ["easerve", "worker"]
    assert by["partition-controller"]["args"][:2] == ["easerve", "partition-controller"]
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    for c in pod["containers"]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert any(m["mountPath"] == "/etc/easerve" for m in c["volumeMounts"])


def test_config_hash_changes_with_config() -> None:
    name, spec, cfg, (dep, _) = _render()
    other = render_omni(name, "ns", spec, cfg + " ", OWNER)[0]
    h = "easerve.io/config-hash"
    assert (
        dep["spec"]["template"]["metadata"]["annotations"][h]
        != other["spec"]["template"]["metadata"]["annotations"][h]
    )


def test_names_are_dns_labels_and_match_the_lead_config_map() -> None:
    from easerve_operator.render import render_children

    name, spec = load_manifest(EXAMPLE)
    children = render_children(name, "ns", "u-1", spec)
    cm = next(o for o in children if o["kind"] == "ConfigMap")
    dep = next(o for o in children if o["kind"] == "Deployment")
    svc = next(o for o in children if o["kind"] == "Service")
    vols = dep["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in vols
    for o in (dep, svc):
        n = o["metadata"]["name"]
        assert "." not in n and len(n) <= 63 and n[0].isalpha(), n


def test_rejects_disaggregated_spec() -> None:
    _, spec = load_manifest(Path(__file__).parents[2] / "examples" / "llava-v1.6-34b.yaml")
    with pytest.raises(ValueError, match="spec.mode"):
        render_omni("x", "ns", spec, "{}", OWNER)


def test_objects_validate_against_kubernetes_schema() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    _, _, _, objs = _render()
    for o in objs:
        kv.validate(o, "1.28", strict=True)
