"""The renderer is a pure function: golden files pin its output for every example."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_operator.render import render_children
from easerve_operator.render.stages import child_name, stage_config_hash
from easerve_runtime.api import RuntimeConfig, load_manifest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
UID = "11111111-2222-3333-4444-555555555555"


def render(path: Path, **updates: Any) -> list[dict[str, Any]]:
    name, spec = load_manifest(path)
    if updates:
        spec = spec.model_validate({**spec.wire(), **updates})
    return render_children(name, "serving", UID, spec)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden(path: Path) -> None:
    """Set EASERVE_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change."""
    text = yaml.safe_dump_all(render(path), sort_keys=False, width=120)
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("EASERVE_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"no golden file; run with EASERVE_UPDATE_GOLDEN=1 to create {golden.name}"
    assert text == golden.read_text(), f"{golden.name} differs; if intended, regenerate with EASERVE_UPDATE_GOLDEN=1"


def test_deterministic() -> None:
    a = yaml.safe_dump_all(render(EXAMPLES[0]))
    b = yaml.safe_dump_all(render(EXAMPLES[0]))
    assert a == b


@pytest.mark.parametrize("path", [p for p in EXAMPLES if "omni" not in p.stem], ids=lambda p: p.stem)
def test_children_and_gpus(path: Path) -> None:
    name, spec = load_manifest(path)
    objs = render(path)
    kinds = [o["kind"] for o in objs]
    assert kinds.count("Deployment") == 3 and kinds.count("Service") == 3 and kinds.count("ConfigMap") == 1
    for o in objs:
        assert o["metadata"]["ownerReferences"][0]["uid"] == UID
        assert o["metadata"]["labels"]["easerve.io/deployment"] == name
        assert len(o["metadata"]["name"]) <= 63 and "." not in o["metadata"]["name"]
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        stage = dep["metadata"]["labels"]["easerve.io/stage"]
        alloc = getattr(spec.allocation, stage)
        pod = dep["spec"]["template"]["spec"]
        gpus = [int(c["resources"]["limits"]["nvidia.com/gpu"]) for c in pod["containers"] if "resources" in c]
        assert gpus == [alloc.tensor_parallel] and dep["spec"]["replicas"] == alloc.replicas
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    cfg = RuntimeConfig.from_json(cm["data"]["config.json"])  # the runtime reads it through the same model
    assert cfg.spec == spec and cfg.name == name


def test_local_prefill_pod_shares_shm_with_the_partition_controller() -> None:
    objs = render(REPO / "examples" / "llava-v1.6-34b.yaml")
    enc = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"]["easerve.io/stage"] == "encode")
    pod = enc["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["containers"]]
    assert names == ["frontend", "encode", "local-prefill", "partition-controller"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    for c in pod["containers"][1:]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    ports = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
    assert len(ports) == len(set(ports)), "containers of one pod share the network namespace"
    # s = 1: no local prefill, no partition controller, no shm volume
    s1 = render(REPO / "examples" / "llava-v1.6-34b.yaml", offload={"ratio": 1.0}, smPartition={"mode": "none"})
    enc1 = next(o for o in s1 if o["kind"] == "Deployment" and o["metadata"]["labels"]["easerve.io/stage"] == "encode")
    assert [c["name"] for c in enc1["spec"]["template"]["spec"]["containers"]] == ["frontend", "encode"]


def test_batch_bound_change_rolls_only_encode() -> None:
    base = render(REPO / "examples" / "llava-v1.6-34b.yaml")
    changed = render(REPO / "examples" / "llava-v1.6-34b.yaml",
                     encode={**load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")[1].encode.wire(), "batchBound": 16})

    def hashes(objs: list[dict[str, Any]]) -> dict[str, str]:
        return {o["metadata"]["labels"]["easerve.io/stage"]: o["spec"]["template"]["metadata"]["annotations"]
                ["easerve.io/config-hash"] for o in objs if o["kind"] == "Deployment"}

    a, b = hashes(base), hashes(changed)
    assert a["encode"] != b["encode"] and a["prefill"] == b["prefill"] and a["decode"] == b["decode"]
    cm = next(o for o in changed if o["kind"] == "ConfigMap")
    assert json.loads(cm["data"]["config.json"])["spec"]["encode"]["batchBound"] == 16


def test_config_hash_covers_what_the_stage_reads() -> None:
    name, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    cfg = RuntimeConfig(name=name, namespace="a", dynamo_namespace="a_x", spec=spec)
    other_model = cfg.model_copy(update={"spec": spec.model_copy(update={"model": spec.model.model_copy(
        update={"name": "other"})})})
    for stage in ("encode", "prefill", "decode"):
        assert stage_config_hash(cfg, stage) != stage_config_hash(other_model, stage)


@pytest.mark.parametrize(("name", "suffix", "expect"), [
    ("llava-v1.6-34b", "encode", "llava-v1-6-34b-encode"),
    ("9lives", "decode", "e-9lives-decode"),
])
def test_child_names_are_dns_labels(name: str, suffix: str, expect: str) -> None:
    assert child_name(name, suffix) == expect


def test_long_names_stay_unique_and_short() -> None:
    a, b = child_name("x" * 80 + "a", "prefill"), child_name("x" * 80 + "b", "prefill")
    assert a != b and len(a) <= 63 and len(b) <= 63 and a.endswith("-prefill")
