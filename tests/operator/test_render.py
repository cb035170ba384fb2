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
from easerve_runtime.api import RuntimeConfig, SpecError, load_manifest
from easerve_runtime.topology import plan

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
    k = plan(spec).local_prefill_tp
    total = 0
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        stage = dep["metadata"]["labels"]["easerve.io/stage"]
        alloc = getattr(spec.allocation, stage)
        pod = dep["spec"]["template"]["spec"]
        gpus = [int(c["resources"]["limits"]["nvidia.com/gpu"]) for c in pod["containers"] if "resources" in c]
        total += sum(gpus) * dep["spec"]["replicas"]
        if stage == "encode":  # one GPU per encode worker, k encode GPUs per pod
            assert gpus == [1] * k and dep["spec"]["replicas"] * k == alloc.replicas
        else:
            assert gpus == [alloc.tensor_parallel] and dep["spec"]["replicas"] == alloc.replicas
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert total == spec.allocation.gpus, "the pods request exactly the allocation's GPUs"
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    cfg = RuntimeConfig.from_json(cm["data"]["config.json"])  # the runtime reads it through the same model
    assert cfg.spec == spec and cfg.name == name


def _encode_pod(objs: list[dict[str, Any]]) -> dict[str, Any]:
    enc = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"]["easerve.io/stage"] == "encode")
    return dict(enc["spec"]["template"]["spec"])


def test_local_prefill_pod_shares_shm_with_the_partition_controller() -> None:
    # the backbone fits one H200: one encode GPU per pod, its local prefill and controller beside it
    pod = _encode_pod(render(REPO / "examples" / "llava-v1.6-34b.yaml", engine={"profile": "llava-v1.6-34b@h200"}))
    names = [c["name"] for c in pod["containers"]]
    assert names == ["frontend", "encode", "local-prefill", "partition-controller"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    for c in pod["containers"][1:]:
        assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    ports = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
    assert len(ports) == len(set(ports)), "containers of one pod share the network namespace"
    # s = 1: no local prefill, no partition controller, no shm volume
    s1 = render(REPO / "examples" / "llava-v1.6-34b.yaml", offload={"ratio": 1.0}, smPartition={"mode": "none"})
    assert [c["name"] for c in _encode_pod(s1)["containers"]] == ["frontend", "encode"]


def test_local_prefill_of_a_tp2_backbone_spans_two_encode_gpus_in_one_pod() -> None:
    """llava-34b needs TP2 on a 48 GB GPU: one local prefill worker over two encode GPUs, as the twin runs it."""
    objs = render(REPO / "examples" / "llava-v1.6-34b.yaml")
    pod = _encode_pod(objs)
    by = {c["name"]: c for c in pod["containers"]}
    assert list(by) == ["frontend", "encode-0", "encode-1", "local-prefill",
                        "partition-controller-0", "partition-controller-1"]
    env = {c: {e["name"]: e.get("value") for e in by[c]["env"]} for c in by}
    assert env["local-prefill"]["EASERVE_PARTITION_GPU"] == "0,1"
    assert (env["encode-0"]["EASERVE_PARTITION_GPU"], env["encode-1"]["EASERVE_PARTITION_GPU"]) == ("0", "1")
    gpu_args = [by[f"partition-controller-{i}"]["args"] for i in (0, 1)]
    assert [a[a.index("--gpu") + 1] for a in gpu_args] == ["0", "1"]
    assert "resources" not in by["local-prefill"], "the local prefill worker shares its pod's encode GPUs"
    ports = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
    assert len(ports) == len(set(ports))
    for c in by.values():  # each worker's Dynamo system server listens where its probe looks
        probe = c.get("readinessProbe", {}).get("httpGet", {}).get("port")
        if probe and c["name"] != "frontend":
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == probe)
            assert env[c["name"]]["DYN_SYSTEM_PORT"] == str(port)


def test_leftover_encode_gpus_are_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"spec\.allocation\.encode\.replicas.*multiple of 2"):
        render(REPO / "examples" / "llava-v1.6-34b.yaml", allocation={
            "encode": {"replicas": 3}, "prefill": {"replicas": 1, "tensorParallel": 2},
            "decode": {"replicas": 1, "tensorParallel": 2}})


def test_omni_partition_controller_gets_the_profiles_ladder() -> None:
    """It exited with status 2 (``--ladder: required``) when rendered without one."""
    from easerve_runtime.omni.profile import load_omni_profile

    path = REPO / "examples" / "qwen2.5-omni.yaml"
    _, spec = load_manifest(path)
    dep = next(o for o in render(path) if o["kind"] == "Deployment")
    pc = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "partition-controller")
    args = pc["args"]
    ladder = [int(x) for x in args[args.index("--ladder") + 1: args.index("--s-aggr")]]
    prof = load_omni_profile(spec.engine.profile)
    assert ladder == list(prof.throttle["ladder"]) and args[args.index("--policy") + 1] == "bandwidth-throttle"
    assert int(args[args.index("--total-sms") + 1]) == prof.total_sms


def test_probes_and_scheduling_are_the_same_in_every_mode() -> None:
    pod_fields = {"nodeSelector": {"gpu": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}
    probes: set[str] = set()
    for path in EXAMPLES:
        for dep in (o for o in render(path, pod=pod_fields) if o["kind"] == "Deployment"):
            pod = dep["spec"]["template"]["spec"]
            assert pod["nodeSelector"] == pod_fields["nodeSelector"], path.stem
            assert pod["tolerations"] == pod_fields["tolerations"], path.stem
            for c in pod["containers"]:
                for kind in ("readinessProbe", "livenessProbe"):
                    if kind in c:
                        p = dict(c[kind])
                        p["httpGet"] = {k: v for k, v in p["httpGet"].items() if k != "port"}
                        probes.add(f"{kind}={json.dumps(p, sort_keys=True)}")
    assert len(probes) == 2, probes  # one readiness and one liveness shape across every mode


def _hashes(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {o["metadata"]["labels"]["easerve.io/stage"]: o["spec"]["template"]["metadata"]["annotations"]
            ["easerve.io/config-hash"] for o in objs if o["kind"] == "Deployment"}


def test_live_knobs_change_the_configmap_and_roll_no_pod() -> None:
    """B, the dispatch parameters and s (within the pod layout) are live knobs (issue 14): the
    encode workers follow the ConfigMap, so their pods must not roll."""
    ex = REPO / "examples" / "llava-v1.6-34b.yaml"
    base = render(ex)
    enc = load_manifest(ex)[1].encode.wire()
    changed = render(ex, encode={**enc, "batchBound": 16, "maxAgeMs": 20, "gapQuantile": 0.8}, offload={"ratio": 0.3})
    assert _hashes(base) == _hashes(changed)
    assert [o["spec"]["template"] for o in base if o["kind"] == "Deployment"] == [
        o["spec"]["template"] for o in changed if o["kind"] == "Deployment"]
    cm = next(o for o in changed if o["kind"] == "ConfigMap")
    cfg = json.loads(cm["data"]["config.json"])["spec"]
    assert cfg["encode"]["batchBound"] == 16 and cfg["offload"]["ratio"] == 0.3


def test_a_change_the_encode_workers_read_at_start_rolls_only_encode() -> None:
    ex = REPO / "examples" / "llava-v1.6-34b.yaml"
    base = render(ex)
    enc = load_manifest(ex)[1].encode.wire()
    for changed in (render(ex, encode={**enc, "sendWindow": 4}),
                    render(ex, smPartition={**load_manifest(ex)[1].sm_partition.wire(), "epsilon": 0.3})):
        a, b = _hashes(base), _hashes(changed)
        assert a["encode"] != b["encode"] and a["prefill"] == b["prefill"] and a["decode"] == b["decode"]


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


def test_admission_and_easerve_render_refuse_leftover_encode_gpus(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The layout rule needs the profile, so it is not a schema rule; the webhook and the CLI still name it."""
    import kopf
    from easerve_operator.cli import main as easerve
    from easerve_operator.reconcile.handlers import validate

    doc = yaml.safe_load((REPO / "examples" / "llava-v1.6-34b.yaml").read_text())
    doc["spec"]["allocation"]["encode"]["replicas"] = 3
    doc["spec"]["allocation"]["decode"]["replicas"] = 1
    with pytest.raises(kopf.AdmissionError, match=r"spec\.allocation\.encode\.replicas"):
        validate(spec=doc["spec"])
    f = tmp_path / "x.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert easerve(["render", "-f", str(f)]) == 2
    assert "spec.allocation.encode.replicas" in capsys.readouterr().err
