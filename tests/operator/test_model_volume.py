"""``spec.model.volume``: the model directory from a PVC or a node path, mounted read-only into every
container that reads it (workers and frontend), never into partition controllers; bad specs are
refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from easerve_operator.render import render_children
from easerve_runtime.api import load_manifest, parse_spec, spec_errors
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]


def torch_spec(volume: dict[str, Any] | None, path: str | None = "/models/llava-next-7b") -> dict[str, Any]:
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    w = spec.wire()
    w["engine"] = {**w["engine"], "backend": "torch", "profile": "llava-v1.6-34b@h200"}
    w["allocation"] = {"encode": {"replicas": 2}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    w["model"] = {**w["model"], "path": path, **({"volume": volume} if volume is not None else {})}
    return w


def deployments(wire: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in render_children("llava", "ns", "uid", parse_spec(wire)) if o["kind"] == "Deployment"]


@pytest.mark.parametrize(
    ("volume", "source"),
    [
        ({"persistentVolumeClaim": "llava-weights"}, {"persistentVolumeClaim": {"claimName": "llava-weights", "readOnly": True}}),
        ({"hostPath": "/srv/models", "mountPath": "/srv/models"}, {"hostPath": {"path": "/srv/models", "type": "Directory"}}),
    ],
)
def test_every_reader_mounts_the_model_read_only(volume: dict[str, Any], source: dict[str, Any]) -> None:
    mount = volume.get("mountPath", "/models")
    deps = deployments(torch_spec(volume, path=f"{mount}/llava-next-7b"))
    readers = 0
    for d in deps:
        pod = d["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
        assert {k: v for k, v in vol.items() if k != "name"} == source
        for c in pod["containers"]:
            mounts = [m for m in c["volumeMounts"] if m["name"] == "model"]
            if c["name"].startswith("partition-controller"):
                assert mounts == []
                continue
            assert mounts == [{"name": "model", "mountPath": mount, "readOnly": True}]
            readers += 1
    assert readers >= 4  # frontend, encode (hosting its local prefill: torch), prefill, decode
    kv = pytest.importorskip("kubernetes_validate")
    for d in deps:  # what the API server would take (strict: an unknown field is an error)
        kv.validate(d, kv.latest_version(), strict=True)


def test_without_a_volume_nothing_is_mounted() -> None:
    for d in deployments(torch_spec(None)):
        pod = d["spec"]["template"]["spec"]
        assert all(v["name"] != "model" for v in pod["volumes"])


@pytest.mark.parametrize(
    ("volume", "path", "field", "words"),
    [
        ({"persistentVolumeClaim": "w", "hostPath": "/srv"}, "/models/x", "spec.model.volume", "exactly one"),
        ({"mountPath": "/models"}, "/models/x", "spec.model.volume", "got none"),
        ({"persistentVolumeClaim": "w"}, "/opt/x", "spec.model.path", "not under spec.model.volume.mountPath"),
        ({"persistentVolumeClaim": "w", "mountPath": "/models"}, "/modelsx/y", "spec.model.path", "not under"),
        ({"persistentVolumeClaim": "Bad_Name"}, "/models/x", "spec.model.volume.persistentVolumeClaim", ""),
        ({"hostPath": "relative/dir"}, "/models/x", "spec.model.volume.hostPath", ""),
    ],
)
def test_bad_volumes_are_refused_naming_the_field(volume: dict[str, Any], path: str, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_spec(torch_spec(volume, path=path))
    msgs = spec_errors(e.value)
    assert any(m.startswith(field) and words in m for m in msgs), msgs
