"""CLI surfaces and Dynamo environment: bad input is reported by field, never silently dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from easerve_operator.cli import main as easerve
from easerve_runtime.api import RuntimeConfig, load_manifest
from easerve_runtime.workers.dynamo_rt import dynamo_env, local_prefill_component
from easerve_runtime.workers.launcher import plan

SPEC = str(Path(__file__).with_name("spec_small.yaml"))


def cfg(backend: str = "file") -> RuntimeConfig:
    _, spec = load_manifest(SPEC)
    spec = spec.model_copy(update={"discovery": spec.discovery.model_copy(update={"backend": backend})})
    return RuntimeConfig(name="t", dynamo_namespace="ns_t", spec=spec)


def test_serve_reports_invalid_spec_by_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = Path(SPEC).read_text().replace("batchBound: 8", "batchBound: 0")
    f = tmp_path / "bad.yaml"
    f.write_text(bad)
    assert easerve(["serve", "-f", str(f)]) == 2
    assert "spec.encode.batchBound" in capsys.readouterr().err


def test_worker_reports_invalid_config(tmp_path: Path) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"name": "x", "dynamoNamespace": "ns", "spec": {"gpuBudget": 0}}))
    with pytest.raises(SystemExit, match=r"config\.spec\.gpuBudget"):
        easerve(["worker", "--stage", "decode", "--config", str(f)])
    with pytest.raises(SystemExit, match="nope.json"):
        easerve(["worker", "--stage", "decode", "--config", str(tmp_path / "nope.json")])


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert easerve(["bench", "--url", "http://127.0.0.1:9", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err


def test_dynamo_env_per_backend() -> None:
    env = dynamo_env(cfg("file"), environ={})
    assert env["DYN_DISCOVERY_BACKEND"] == "file" and env["DYN_FILE_KV"].endswith("ns_t")
    assert env["DYN_REQUEST_PLANE"] == "tcp" and int(env["DYN_TCP_MAX_MESSAGE_SIZE"]) > 1 << 20
    assert (
        dynamo_env(cfg("file"), environ={"DYN_FILE_KV": "/x", "DYN_TCP_MAX_MESSAGE_SIZE": "5"}).get(
            "DYN_FILE_KV"
        )
        is None
    )
    assert dynamo_env(cfg("file"), discovery="etcd", environ={})["DYN_DISCOVERY_BACKEND"] == "etcd"
    with pytest.raises(ValueError, match="POD_NAME"):
        dynamo_env(cfg("kubernetes"), environ={})
    ok = dynamo_env(cfg("kubernetes"), environ={"POD_NAME": "p", "POD_NAMESPACE": "n", "POD_UID": "u"})
    assert ok["DYN_DISCOVERY_BACKEND"] == "kubernetes"
    assert local_prefill_component("enc-pod-0.x") == "local_prefill_enc_pod_0_x"


def test_serve_plan_follows_allocation() -> None:
    _, spec = load_manifest(SPEC)
    stages = [p.stage for p in plan(spec, 8000)]
    assert stages == ["decode", "decode", "prefill", "local-prefill", "encode", "frontend"]
    all_remote = spec.model_copy(update={"offload": spec.offload.model_copy(update={"ratio": 1.0})})
    assert "local-prefill" not in [p.stage for p in plan(all_remote, 8000)]
    ports = [p.system_port for p in plan(spec, 8000)]
    assert len(set(ports)) == len(ports) and max(ports) < 32768  # Dynamo parses the port as i16
