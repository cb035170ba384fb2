"""Open profiles: a user's profile file (path or ConfigMap) in the shipped schema, one loader for
every consumer, the encoder check, the "exactly one source" rule and the rendered mount."""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from easerve_operator.cli import main
from easerve_operator.render import render_children
from easerve_runtime.api import (
    PROFILE_DIR,
    PROFILE_DIR_ENV,
    PROFILE_KEY,
    SpecError,
    load_manifest,
    parse_spec,
)
from easerve_runtime.profiles import (
    ProfileFileError,
    load_profile,
    load_profile_file,
    parse_profile_file,
    profile_errors,
    spec_profile,
)
from easerve_runtime.profiles.schema import (
    EncoderAnchorsDoc,
    GPUDoc,
    LinkDoc,
    ModelsDoc,
)
from pydantic import ValidationError

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
EXAMPLE = HERE / "data" / "llava-graphs@h100-sxm.json"
GOLDEN = HERE / "golden"
UID = "11111111-2222-3333-4444-555555555555"


def _data(name: str) -> dict[str, Any]:
    text = resources.files("easerve_runtime.profiles").joinpath("data").joinpath(name).read_text()
    return dict(json.loads(text))


def _spec(**engine: Any) -> dict[str, Any]:
    _, spec = load_manifest(REPO / "examples" / "llava-v1.6-34b.yaml")
    d = spec.wire()
    d["engine"] = {"backend": "sim", **engine}
    return d


# ------------------------------------------------------------------------------ the schema
def test_shipped_data_follows_the_schema_a_file_uses() -> None:
    """The file schema IS the shipped one: every shipped entry validates against it."""
    models = ModelsDoc.model_validate(_data("models.json"))
    assert set(models.models) == {"llava-v1.6-34b", "qwen2.5-vl-32b", "ultravox-v0.6-27b"}
    gpus = {k: GPUDoc.model_validate(v) for k, v in _data("gpus.json").items() if not k.startswith("_")}
    links = {k: LinkDoc.model_validate(v) for k, v in _data("links.json").items() if not k.startswith("_")}
    assert {g.link for g in gpus.values()} <= set(links)
    for name, tables in _data("h200_anchors.json")["encoders"].items():
        assert name in models.encoders
        EncoderAnchorsDoc.model_validate(tables)


def test_a_file_that_names_a_shipped_profile_is_that_profile() -> None:
    shipped = load_profile("ultravox-v0.6-27b@a100-80gb")
    own = parse_profile_file({"profile": "ultravox-v0.6-27b@a100-80gb"})
    assert own.encoder == shipped.encoder and own.backbone == shipped.backbone and own.hw == shipped.hw
    for b in (1, 4, 16):
        assert own.encode_s(b) == shipped.encode_s(b)
    assert own.prefill_s(2048, tp=2) == shipped.prefill_s(2048, tp=2)
    assert own.decode_step_s(32, 32 * 2048) == shipped.decode_step_s(32, 32 * 2048)


def test_new_encoder_and_new_gpu_from_a_file() -> None:
    """The example file adds an encoder (CLIP under CUDA graphs) and a GPU (H100 SXM)."""
    p = load_profile_file(EXAMPLE)
    doc = json.loads(EXAMPLE.read_text())
    graph = doc["h200_anchors"]["encoders"]["clip-vit-l-336-graphs"]["graph_ms"]
    gpu = doc["gpus"]["h100-sxm"]
    assert p.name == "llava-v1.6-34b-graphs@h100-sxm" and p.encoder == "clip-vit-l-336-graphs"
    assert p.sms == gpu["sms"] and p.gpu_memory_bytes == gpu["memory_bytes"]
    ref = load_profile("llava-v1.6-34b@h200")
    flops_ratio = ref.hw.flops_per_s / p.hw.flops_per_s
    for b, ms in graph.items():  # graph-only: the curve itself, scaled by the FLOP ratio, no host floor
        assert p.encode_s(int(b)) * 1e3 == pytest.approx(ms * flops_ratio, rel=1e-9)
    assert p.encode_s(1) < ref.encode_s(1)  # the shipped eager CLIP pays its launch-bound floor
    # same backbone and datasheet FLOPs as the H200: prefill is the same compute; decode is
    # bandwidth-bound, so the lower HBM bandwidth of the H100 makes it slower
    assert p.prefill_s(4096) == pytest.approx(ref.prefill_s(4096), rel=1e-9)
    assert p.decode_step_s(8, 8 * 2048) > ref.decode_step_s(8, 8 * 2048)


def _write(tmp_path: Path, doc: Any, name: str = "p.json") -> Path:
    f = tmp_path / name
    f.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return f


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["models"]["encoders"]["clip-vit-l-336-graphs"].pop("tokens_per_item"),
         r"models\.encoders\.clip-vit-l-336-graphs\.tokens_per_item: Field required"),
        (lambda d: d["gpus"]["h100-sxm"].update(sms=0),
         r"gpus\.h100-sxm\.sms: Input should be greater than 0"),
        (lambda d: d["h200_anchors"]["encoders"]["clip-vit-l-336-graphs"].update(graph_ms={"1": 2.0}),
         r"graph_ms: needs at least two batch sizes"),
        (lambda d: d["h200_anchors"]["encoders"]["clip-vit-l-336-graphs"].update(graph_ms={"x": 1, "2": 2}),
         r"graph_ms: batch sizes are positive integers"),
        (lambda d: d["h200_anchors"].pop("encoders"),
         r"h200_anchors\.encoders\.clip-vit-l-336-graphs: the encoder has no measured H200 curve"),
        (lambda d: d["models"]["models"]["llava-v1.6-34b-graphs"].update(encoder="siglip"),
         r"models\.models\.llava-v1\.6-34b-graphs\.encoder: 'siglip' is not in models\.encoders"),
        (lambda d: d["gpus"]["h100-sxm"].update(link="infiniband"),
         r"gpus\.h100-sxm\.link: 'infiniband' is not in links"),
        (lambda d: d.update(profile="llava-v1.6-34b-graphs@b200"), r"unknown profile 'llava-v1\.6-34b-graphs@b200'"),
        (lambda d: d.update(backbones={}), r"backbones: unknown field"),
        (lambda d: d["h200_anchors"].update(backbones={}), r"h200_anchors\.backbones: unknown field"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_and_the_field(tmp_path: Path, mutate: Any, expected: str) -> None:
    doc = json.loads(EXAMPLE.read_text())
    mutate(doc)
    f = _write(tmp_path, doc)
    with pytest.raises(ProfileFileError, match=expected) as info:
        load_profile_file(f)
    assert str(f) in str(info.value)


def test_unreadable_and_non_json_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match="cannot read"):
        load_profile_file(tmp_path / "missing.json")
    with pytest.raises(ProfileFileError, match="not JSON"):
        load_profile_file(_write(tmp_path, "{not json"))


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    f = _write(tmp_path, {"profile": "llava-v1.6-34b@h200"})
    assert load_profile_file(f).gpu == "h200"
    f.write_text(json.dumps({"profile": "llava-v1.6-34b@a100-80gb"}))
    assert load_profile_file(f).gpu == "a100-80gb"


# ------------------------------------------------------------------------------ the spec
def test_exactly_one_profile_source() -> None:
    names = r"spec\.engine\.profile .*spec\.engine\.profileFile .*spec\.engine\.profileConfigMap"
    with pytest.raises(ValidationError, match=names + r".*got none"):
        parse_spec(_spec())
    with pytest.raises(ValidationError, match=r"got spec\.engine\.profile, spec\.engine\.profileFile"):
        parse_spec(_spec(profile="llava-v1.6-34b@h200", profileFile="/x.json"))
    for one in ({"profile": "llava-v1.6-34b@h200"}, {"profileFile": "/x.json"}, {"profileConfigMap": "my-profile"}):
        assert parse_spec(_spec(**one)).engine.profile_config_map == one.get("profileConfigMap")
    with pytest.raises(ValidationError, match="profileConfigMap"):
        parse_spec(_spec(profileConfigMap="Not_A_Name"))


def test_encoder_mismatch_is_refused_naming_both() -> None:
    """The bug of issue 16: whisper-medium with a Whisper-large-v3 profile ran on the wrong costs."""
    _, spec = load_manifest(REPO / "examples" / "ultravox-v0.6-27b.yaml")
    bad = spec.model_copy(update={"model": spec.model.model_copy(update={"encoder": "whisper-medium"})})
    with pytest.raises(SpecError) as info:
        spec_profile(bad)
    assert info.value.path == "spec.model.encoder"
    assert "'whisper-medium'" in info.value.message and "'whisper-large-v3'" in info.value.message
    assert [e.path for e in profile_errors(bad)] == ["spec.model.encoder"]
    assert profile_errors(spec) == [] and spec_profile(spec).encoder == "whisper-large-v3"


def test_encoder_must_match_a_files_new_encoder(tmp_path: Path) -> None:
    spec = parse_spec(_spec(profileFile=str(EXAMPLE)))  # the manifest says clip-vit-l-336
    with pytest.raises(SpecError, match=r"'clip-vit-l-336'.*'clip-vit-l-336-graphs'"):
        spec_profile(spec)
    d = _spec(profileFile=str(EXAMPLE))
    d["model"]["encoder"] = "clip-vit-l-336-graphs"
    assert spec_profile(parse_spec(d)).name == "llava-v1.6-34b-graphs@h100-sxm"


def test_a_bad_file_in_a_spec_names_the_spec_field(tmp_path: Path) -> None:
    spec = parse_spec(_spec(profileFile=str(tmp_path / "nope.json")))
    with pytest.raises(SpecError) as info:
        spec_profile(spec)
    assert info.value.path == "spec.engine.profileFile" and "nope.json" in info.value.message
    assert profile_errors(spec) == []  # not readable here: the workers check it when they start


def test_config_map_source_reads_the_mounted_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _spec(profileConfigMap="llava-graphs")
    d["model"]["encoder"] = "clip-vit-l-336-graphs"
    spec = parse_spec(d)
    monkeypatch.setenv(PROFILE_DIR_ENV, str(tmp_path))
    with pytest.raises(SpecError, match=rf"spec\.engine\.profileConfigMap: ConfigMap 'llava-graphs'.*{PROFILE_KEY}"):
        spec_profile(spec)
    shutil.copy(EXAMPLE, tmp_path / PROFILE_KEY)
    assert spec_profile(spec).encoder == "clip-vit-l-336-graphs"
    monkeypatch.delenv(PROFILE_DIR_ENV)
    with pytest.raises(SpecError, match=re.escape(f"{PROFILE_DIR}/{PROFILE_KEY}")):
        spec_profile(spec)


# ------------------------------------------------------------------------------ every consumer
def _file_spec() -> Any:
    d = _spec(profileFile=str(EXAMPLE))
    d["model"]["encoder"] = "clip-vit-l-336-graphs"
    return parse_spec(d)


def test_every_consumer_loads_the_file(tmp_path: Path) -> None:
    import argparse

    from easerve_operator.tuning.runners.sim import SimStageProfiler
    from easerve_runtime.api import RuntimeConfig
    from easerve_runtime.cli.partition_controller import _spec_policy
    from easerve_runtime.engines.sim import SimEngine
    from easerve_runtime.sim import model_for, simulate
    from easerve_runtime.sim.runner import cached_model, run_trial
    from easerve_runtime.workload import generate

    spec = _file_spec()
    want = load_profile_file(EXAMPLE)
    assert SimEngine.for_spec(spec).profile is want
    assert model_for(spec).profile is want and cached_model(spec).profile is want
    assert SimStageProfiler(spec)._inner.model.profile is want
    res = simulate(spec, generate(spec, 1.0, 20, seed=0))
    assert res.summary["completed"] == 20
    assert run_trial(spec, 1.0, 20, 0)["completed"] == 20
    cfg = tmp_path / "config.json"
    cfg.write_text(RuntimeConfig(name="x", dynamo_namespace="x", spec=spec).to_json())
    args = argparse.Namespace(config=cfg, policy=None, static_sms=None, table=None, ladder=None, total_sms=None, gpu=0)
    policy = _spec_policy(args)
    assert policy is not None and policy.total_sms == want.sms


def test_easerve_sim_and_render_refuse_a_wrong_encoder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((REPO / "examples" / "ultravox-v0.6-27b.yaml").read_text())
    doc["spec"]["model"]["encoder"] = "whisper-medium"
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(doc))
    for argv in (["sim", "-f", str(f), "--requests", "5"], ["render", "-f", str(f)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "spec.model.encoder" in err and "whisper-medium" in err and "whisper-large-v3" in err


def test_easerve_sim_runs_a_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = yaml.safe_load((REPO / "examples" / "llava-v1.6-34b.yaml").read_text())
    doc["spec"]["model"]["encoder"] = "clip-vit-l-336-graphs"
    doc["spec"]["engine"] = {"backend": "sim", "profileFile": str(EXAMPLE)}
    f = tmp_path / "own.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert main(["sim", "-f", str(f), "--requests", "30", "--rate", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["profile"] == "llava-v1.6-34b-graphs@h100-sxm" and out["completed"] == 30


def test_omni_profile_file(tmp_path: Path) -> None:
    from easerve_runtime.sim.omni import run

    _, spec = load_manifest(REPO / "examples" / "qwen2.5-omni.yaml")
    src = resources.files("easerve_runtime.omni").joinpath("data").joinpath(f"{spec.engine.profile}.json")
    f = tmp_path / "omni.json"
    f.write_text(src.read_text())
    own = spec.model_copy(update={"engine": spec.engine.model_copy(update={"profile": None, "profile_file": str(f)})})
    a = run(spec, "horizon", 1.0, 40, 0)
    b = run(own, "horizon", 1.0, 40, 0)
    assert a["slo_attainment"] == b["slo_attainment"] and a["per_class"] == b["per_class"]


# ------------------------------------------------------------------------------ the mount
def _render_with_config_map(example: str) -> list[dict[str, Any]]:
    name, spec = load_manifest(REPO / "examples" / f"{example}.yaml")
    engine = {**spec.engine.wire(), "profileConfigMap": f"{name}-profile"}
    engine.pop("profile")
    spec = parse_spec({**spec.wire(), "engine": engine})
    return render_children(name, "serving", UID, spec)


@pytest.mark.parametrize("example", ["llava-v1.6-34b", "qwen2.5-omni"])
def test_config_map_is_mounted_in_every_container(example: str) -> None:
    objs = _render_with_config_map(example)
    deployments = [o for o in objs if o["kind"] == "Deployment"]
    assert deployments
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        vols = [v for v in pod["volumes"] if v["name"] == "profile"]
        assert vols == [
            {
                "name": "profile",
                "configMap": {"name": f"{example}-profile", "items": [{"key": PROFILE_KEY, "path": PROFILE_KEY}]},
            }
        ]
        for c in pod["containers"]:
            assert {"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True} in c["volumeMounts"]
    # nothing is added when the spec names a shipped profile
    name, spec = load_manifest(REPO / "examples" / f"{example}.yaml")
    for o in render_children(name, "serving", UID, spec):
        if o["kind"] == "Deployment":
            assert all(v["name"] != "profile" for v in o["spec"]["template"]["spec"]["volumes"])


def test_config_map_render_golden() -> None:
    """EASERVE_UPDATE_GOLDEN=1 rewrites it; the mount is the only difference from the example's golden."""
    import os

    text = yaml.safe_dump_all(_render_with_config_map("llava-v1.6-34b"), sort_keys=False, width=120)
    golden = GOLDEN / "llava-v1.6-34b-profile-configmap.yaml"
    if os.environ.get("EASERVE_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


def test_docs_example_is_the_tested_file() -> None:
    """docs/profiles.md shows the example profile file; it must be the one these tests load."""
    md = (REPO / "docs" / "profiles.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", md, flags=re.S)
    assert any(json.loads(b) == json.loads(EXAMPLE.read_text()) for b in blocks)


def test_admission_and_reconcile_refuse_a_wrong_encoder() -> None:
    """The webhook and the reconciler share ``check_spec``: a shipped profile's encoder is checked there."""
    from easerve_operator.reconcile.loop import check_spec as _parse

    _, spec = load_manifest(REPO / "examples" / "ultravox-v0.6-27b.yaml")
    good = spec.wire()
    assert _parse(good)[0] is not None
    bad = {**good, "model": {**good["model"], "encoder": "whisper-medium"}}
    parsed, errors = _parse(bad)
    assert parsed is None and len(errors) == 1
    assert errors[0].startswith("spec.model.encoder: ") and "whisper-large-v3" in errors[0]


def _fabric_file(tmp_path: Path, embedding_ms: float) -> Path:
    """The shipped LLaVA profile on an H200 whose NVLink entry carries its own embedding setup cost."""
    links = _data("links.json")
    return _write(tmp_path, {"profile": "llava-v1.6-34b@h200",
                             "links": {"nvlink": {**links["nvlink"], "embedding_setup_ms": embedding_ms}}},
                  name=f"fabric-{embedding_ms}.json")


def test_a_fabric_sets_the_setup_of_each_transfer_path(tmp_path: Path) -> None:
    """The embedding and KV paths each have a setup cost; a file sets one without the other."""
    shipped = load_profile("llava-v1.6-34b@h200")
    base = shipped.hw.link.transfer_setup_s
    assert shipped.transfer_s(0, path="embedding") == shipped.transfer_s(0, path="kv") == pytest.approx(base)
    slow = load_profile_file(_fabric_file(tmp_path, 250.0))
    assert slow.transfer_s(0, path="embedding") == pytest.approx(0.25)
    assert slow.transfer_s(0, transfers=4, path="embedding") == pytest.approx(1.0)
    assert slow.transfer_s(0, path="kv") == pytest.approx(base)  # the KV path keeps the link's own
    assert slow.transfer_s(0, path="kv_ipc") == pytest.approx(base)  # same-GPU handoffs: the KV path's, unless set
    with pytest.raises(ValueError, match="'embedding', 'kv' or 'kv_ipc'"):
        slow.transfer_s(1, path="rdma")
    doc = json.loads(_fabric_file(tmp_path, 1.0).read_text())
    doc["links"]["nvlink"].update(kv_setup_ms=150.0, kv_ipc_setup_ms=6.0)
    ipc = load_profile_file(_write(tmp_path, doc, name="ipc.json"))
    assert ipc.transfer_s(0, path="kv") == pytest.approx(0.150) and ipc.transfer_s(0, path="kv_ipc") == pytest.approx(0.006)
    nbytes = ipc.kv_bytes(2500)  # a device-to-device copy: its bytes read and written in HBM, not sent on the link
    assert ipc.transfer_s(nbytes, path="kv_ipc") - 0.006 == pytest.approx(2 * nbytes / ipc.hw.hbm_bytes_per_s)
    bad = json.loads(_fabric_file(tmp_path, 1.0).read_text())
    bad["links"]["nvlink"]["kv_setup_ms"] = -1
    with pytest.raises(ProfileFileError, match=r"links\.nvlink\.kv_setup_ms"):
        parse_profile_file(bad)


def test_envelopes_amortise_the_embedding_setup_in_the_twin(tmp_path: Path) -> None:
    """On the twin, the embedding setup is paid once per envelope. All prefill remote (s = 1),
    under a load at which micro-batches form: pass-through (B = 1) pays it on every request, B = 8
    on fewer transfers, so its TTFT grows less with the cost."""
    from easerve_runtime.sim import simulate
    from easerve_runtime.workload import generate

    def run(embedding_ms: float, b: int) -> dict[str, Any]:
        d = _spec(profileFile=str(_fabric_file(tmp_path, embedding_ms)))
        d["encode"]["batchBound"] = b
        d["offload"]["ratio"], d["smPartition"]["mode"] = 1.0, "none"
        spec = parse_spec(d)
        res = simulate(spec, generate(spec, 30.0, 80, seed=0))
        return {"ttft": res.summary["ttft_mean"], "transfers": res.stats["embedding_transfers"],
                "batch": res.stats["mean_encode_batch"], "completed": res.summary["completed"]}

    cheap1, dear1 = run(0.3, 1), run(200.0, 1)
    cheap8, dear8 = run(0.3, 8), run(200.0, 8)
    assert cheap1["completed"] == dear1["completed"] == cheap8["completed"] == dear8["completed"] == 80
    assert dear1["transfers"] == 80 and dear8["batch"] > 1.0
    assert dear8["transfers"] < dear1["transfers"]  # one transfer per destination per micro-batch
    assert dear1["ttft"] - cheap1["ttft"] >= 0.2 * 0.9  # every request pays one setup at least
    assert dear8["ttft"] - cheap8["ttft"] < dear1["ttft"] - cheap1["ttft"]


# ------------------------------------------------------------------------------ measured on an engine
def _engine_doc() -> dict[str, Any]:
    return {
        "profile": "llava-v1.6-34b@h200",
        "engine": {
            "engine": "torch", "device": "cuda:0 (test)",
            "encode": [{"items": 5, "ms": 40.0}, {"items": 5, "ms": 44.0}, {"items": 40, "ms": 230.0}],
            "prefill": [{"tokens": 2900, "ms": 300.0}],
            "decode": [{"batch": 1, "context_tokens": 2900, "ms": 45.0}, {"batch": 32, "context_tokens": 96000, "ms": 70.0}],
        },
    }



def _engine_spec(tmp_path: Path, name: str, **engine: Any) -> Any:
    """The spec of a sim deployment whose profile file is ``_engine_doc`` with ``engine``'s fields set."""
    doc = _engine_doc()
    doc["engine"].update(engine)
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(doc))
    return parse_spec(_spec(profileFile=str(f)))

def test_an_engine_section_reproduces_its_measurements_and_keeps_the_models_shape() -> None:
    """At a measured point the corrected profile gives the measured time (the median of repeats);
    what was not measured (SM share, TP, context) keeps the analytic model's dependence."""
    plain = parse_profile_file({"profile": "llava-v1.6-34b@h200"})
    p = parse_profile_file(_engine_doc())
    assert p.encode_s(5) == pytest.approx(0.042) and p.encode_s(40) == pytest.approx(0.230)
    assert p.prefill_s(2900) == pytest.approx(0.300)
    assert p.decode_step_s(1, 2900) == pytest.approx(0.045) and p.decode_step_s(32, 96000) == pytest.approx(0.070)
    # the share penalty of a local prefill and the growth with context are the model's
    assert p.prefill_s(2900, sm_share=0.5) / p.prefill_s(2900) == pytest.approx(
        plain.prefill_s(2900, sm_share=0.5) / plain.prefill_s(2900))
    assert p.decode_step_s(1, 5800) / p.decode_step_s(1, 2900) == pytest.approx(
        plain.decode_step_s(1, 5800) / plain.decode_step_s(1, 2900))
    # between measured batches the ratio is interpolated, beyond them it stays the end's
    r5, r40 = (p.encode_s(b) / plain.encode_s(b) for b in (5, 40))
    assert min(r5, r40) <= p.encode_s(12) / plain.encode_s(12) <= max(r5, r40)
    assert p.encode_s(64) / plain.encode_s(64) == pytest.approx(r40)
    assert p.corrections is not None and p.corrections.summary()["source"] == "torch on cuda:0 (test)"
    assert plain.corrections is None


def test_the_encoders_host_part_is_read_as_its_share_of_the_measured_encode() -> None:
    """``engine.encode_host`` (a CPU-preprocessing encoder: image decode and the processor on the
    host) is read as a share of the measured encode at the same items: interpolated between points,
    the end's beyond them, never above the whole; the twin's stage model turns it back into seconds.
    A profile without it has no host part (preprocessing on the GPU)."""
    from easerve_runtime.sim.latency import StageModel

    doc = _engine_doc()
    doc["engine"]["encode_host"] = [{"items": 5, "ms": 21.0}, {"items": 40, "ms": 46.0}]
    p = parse_profile_file(doc)
    assert p.encode_host_share(5) == pytest.approx(0.5) and p.encode_host_share(40) == pytest.approx(0.2)
    assert 0.2 < p.encode_host_share(12) < 0.5 and p.encode_host_share(64) == pytest.approx(0.2)
    assert StageModel(p).encode_host_s(5) == pytest.approx(0.021) and StageModel(p).encode_host_s(0) == 0.0
    assert p.corrections is not None and p.corrections.summary()["encode_host"] == {"5": 0.5, "40": 0.2}
    doc["engine"]["encode_host"] = [{"items": 5, "ms": 99.0}]  # more than the whole: the whole
    assert parse_profile_file(doc).encode_host_share(5) == 1.0
    plain = parse_profile_file(_engine_doc())
    assert plain.encode_host_share(5) == 0.0 and StageModel(plain).encode_host_s(5) == 0.0


def test_an_encoders_host_part_leaves_the_shared_gpu_to_prefill_in_the_twin(tmp_path: Path) -> None:
    """On a GPU that the pods share under MPS, an encoder batch is GPU work in flight only after its
    host part: the same encode times with most of them on the host charge the prefill that runs
    beside it less (``stats.prefill.over_profile``), and the encoder itself is not slowed for the
    host part (``encode_ms_per_batch``); every request is still served."""
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    caps = {"encode": 0.85, "prefill": 0.85}
    out = {}
    for name, host in (("gpu", []), ("cpu", [{"items": 5, "ms": 36.0}, {"items": 40, "ms": 200.0}])):
        spec = _engine_spec(tmp_path, name, encode_host=host)
        wire = spec.wire()  # Dynamo-style's layout: one pod a stage, every prefill remote
        wire["allocation"] = {"encode": {"replicas": 1}, "prefill": {"replicas": 1, "tensorParallel": 2},
                              "decode": {"replicas": 1, "tensorParallel": 2}}
        wire["offload"] = {"ratio": 1.0}
        wire["smPartition"] = {"mode": "none"}
        spec = parse_spec(wire)
        reqs = generate(spec, 1.0, 120, 5)
        res = simulate_system(spec, reqs, "easerve", host_gpus=1, mps_caps=caps)
        assert len([r for r in res.records if r.ok]) == 120
        out[name] = res.stats
    assert out["cpu"]["prefill"]["prefill"]["over_profile"] < out["gpu"]["prefill"]["prefill"]["over_profile"]
    assert out["cpu"]["encode_ms_per_batch"] < out["gpu"]["encode_ms_per_batch"]


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["engine"]["decode"][0].pop("context_tokens"), "engine.decode.0.context_tokens: Field required"),
        (lambda d: d["engine"]["encode"][1].update(ms=0), "engine.encode.1.ms: Input should be greater than 0"),
        (lambda d: d["engine"].update(speed=1), "engine.speed: unknown field"),
    ],
)
def test_a_bad_engine_section_is_refused_naming_the_field(tmp_path: Path, mutate: Any, expected: str) -> None:
    doc = _engine_doc()
    mutate(doc)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ProfileFileError, match=re.escape(expected)):
        load_profile_file(f)


def test_the_twin_runs_on_an_engine_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A spec pointed at an engine-measured profile runs in the twin with the measured costs: a
    slower measured decode gives a longer TPOT than the shipped profile does."""
    slow = _engine_doc()
    slow["engine"]["decode"] = [{"batch": 1, "context_tokens": 2900, "ms": 200.0}, {"batch": 64, "context_tokens": 190000, "ms": 260.0}]
    f = tmp_path / "measured.json"
    f.write_text(json.dumps(slow))
    out = {}
    for name, engine in (("shipped", {"profile": "llava-v1.6-34b@h200"}), ("measured", {"profileFile": str(f)})):
        m = tmp_path / f"{name}.yaml"
        doc = {"apiVersion": "easerve.io/v1alpha1", "kind": "EPDDeployment", "metadata": {"name": "x"}, "spec": _spec(**engine)}
        m.write_text(yaml.safe_dump(doc))
        assert main(["sim", "-f", str(m), "--requests", "60", "--rate", "1", "--json"]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["measured"]["profile"] == out["shipped"]["profile"] == "llava-v1.6-34b@h200"
    assert out["measured"]["completed"] == out["shipped"]["completed"] == 60
    assert out["measured"]["tpot_mean"] > 2 * out["shipped"]["tpot_mean"], {k: v["tpot_mean"] for k, v in out.items()}


def test_the_committed_h200_engine_profile_reads_back() -> None:
    """The profile measured on the H200 (benchmarks/twin_agreement.py --measure) stays a valid
    profile file: docs/benchmarks.md and the agreement report read it."""
    f = REPO / "benchmarks" / "results" / "engine_profile_h200_llava7b.json"
    doc = json.loads(f.read_text())
    p = load_profile_file(f)
    assert p.name == doc["profile"] and p.corrections is not None
    assert p.backbone.layers == doc["models"]["backbones"][f"{p.model}-backbone"]["layers"]
    for pt in doc["engine"]["decode"]:
        assert p.decode_step_s(pt["batch"], pt["context_tokens"]) * 1e3 == pytest.approx(pt["ms"])


@pytest.mark.parametrize("system", ["easerve", "dynamo", "aggregated"])
def test_the_request_path_delays_every_first_token_by_its_length_in_the_twin(tmp_path: Path, system: str) -> None:
    """``engine.request_path_ms`` is a delay on each request's way in, no worker busy for it: the
    whole run shifts by it, so every request's TTFT grows by exactly that, at any load."""
    from easerve_runtime.sim import simulate
    from easerve_runtime.workload import generate

    ttft = {}
    for path_ms in (0.0, 200.0):
        spec = _engine_spec(tmp_path, f"p{path_ms}", request_path_ms=path_ms)
        reqs = generate(spec, 2.0, 80, 3)
        res = simulate(spec, reqs, system, sweep=False)
        ttft[path_ms] = {r.id: r.first_token_s - r.arrival_s for r in res.records if r.ok}
    assert ttft[0.0].keys() == ttft[200.0].keys() and len(ttft[0.0]) == 80
    for rid, t in ttft[0.0].items():
        assert ttft[200.0][rid] == pytest.approx(t + 0.2, abs=1e-9), rid


def test_the_decode_loop_overhead_is_added_to_every_decode_step_of_the_twin(tmp_path: Path) -> None:
    """``engine.decode_loop_overhead_ms`` is the served loop's host time per iteration: with the GPU
    to itself (one replica, no shared host GPU), every request's tokens after the first arrive one
    step plus that overhead apart, so the mean TPOT grows by exactly it at low load; the request's
    first token (prefill) does not move."""
    from easerve_runtime.sim import simulate
    from easerve_runtime.workload import generate

    res = {}
    for ms in (0.0, 5.0):
        spec = _engine_spec(tmp_path, f"o{ms}", decode_loop_overhead_ms=ms)
        assert spec_profile(spec).decode_overhead_s == pytest.approx(ms / 1e3)
        reqs = generate(spec, 0.05, 6, 3)  # 20 s apart: every request decodes alone
        outputs = {r.id: r.output_tokens for r in reqs}
        res[ms] = {r.id: r for r in simulate(spec, reqs, "easerve", sweep=False).records if r.ok}
    assert res[0.0].keys() == res[5.0].keys() and len(res[0.0]) == 6
    for rid, r0 in res[0.0].items():
        r5 = res[5.0][rid]
        assert r5.first_token_s == pytest.approx(r0.first_token_s, abs=1e-9)
        steps = outputs[rid] - 1
        assert (r5.finish_s - r5.first_token_s) - (r0.finish_s - r0.first_token_s) == pytest.approx(steps * 0.005, rel=1e-6)


def test_the_decode_loops_row_cost_is_paid_per_running_sequence(tmp_path: Path) -> None:
    """``engine.decode_loop_row_ms`` is the served loop's host time per running sequence per
    iteration (its token fanned out to the request's stream): a request decoding alone pays it once
    a step; two decoding together pay it twice a step each; the first token does not move."""
    from easerve_runtime.sim import simulate
    from easerve_runtime.workload import generate

    gaps: dict[float, dict[str, dict[int, float]]] = {}
    for ms in (0.0, 2.0):
        spec = _engine_spec(tmp_path, f"r{ms}", decode_loop_row_ms=ms)
        assert spec_profile(spec).decode_row_overhead_s == pytest.approx(ms / 1e3)
        gaps[ms] = {}
        for name, rate in (("alone", 0.05), ("busy", 50.0)):
            reqs = generate(spec, rate, 6, 3)
            recs = [r for r in simulate(spec, reqs, "easerve", sweep=False).records if r.ok]
            assert len(recs) == 6
            gaps[ms][name] = {r.id: r.finish_s - r.first_token_s for r in recs}
            if name == "alone":
                outputs = {r.id: r.output_tokens for r in reqs}
                firsts = {r.id: r.first_token_s for r in recs}
                if ms == 0.0:
                    first0 = firsts
                else:
                    assert firsts == pytest.approx(first0, abs=1e-9)
    for rid, g0 in gaps[0.0]["alone"].items():  # one row a step: the row cost once a step
        assert gaps[2.0]["alone"][rid] - g0 == pytest.approx((outputs[rid] - 1) * 0.002, rel=1e-6)
    # rows decoding together pay more than one row's worth a step
    extra = {rid: gaps[2.0]["busy"][rid] - g0 for rid, g0 in gaps[0.0]["busy"].items()}
    assert any(extra[rid] > 1.5 * (outputs[rid] - 1) * 0.002 for rid in extra)


def test_a_sequential_engine_prefills_whole_prompts_and_pays_prefill_plus_decode_in_the_aggregated_twin(tmp_path: Path) -> None:
    """``engine.mixed_iteration: sequential`` (the torch engine's aggregated worker) times an
    iteration as prefill + decode step, not the larger of the two, and prefills whole prompts:
    the same work takes longer than under ``fused``, and no prompt is split over iterations."""
    from easerve_runtime.sim import simulate
    from easerve_runtime.workload import generate

    out = {}
    for mode in ("fused", "sequential"):
        spec = _engine_spec(tmp_path, mode, mixed_iteration=mode)
        assert spec_profile(spec).mixed_iteration == mode
        reqs = generate(spec, 4.0, 60, 3)
        r = simulate(spec, reqs, "aggregated", sweep=False)
        out[mode] = r
    assert out["fused"].summary["completed"] == out["sequential"].summary["completed"] == 60
    assert out["sequential"].stats["prefilled_tokens"] == out["fused"].stats["prefilled_tokens"]
    assert out["sequential"].summary["tpot"]["mean"] > out["fused"].summary["tpot"]["mean"]
    # whole prompts: the iterations that prefill are at most one per request's prompt, and each
    # prompt runs in one (fused chunks split long prompts over several)
    assert out["sequential"].stats["iterations"] < out["fused"].stats["iterations"]


def test_an_unknown_mixed_iteration_is_refused_naming_the_field() -> None:
    doc = _engine_doc()
    doc["engine"]["mixed_iteration"] = "overlapped"
    with pytest.raises(ValueError, match="engine.mixed_iteration"):
        parse_profile_file(doc)


def test_the_admission_capacity_reads_a_profile_file(tmp_path: Path) -> None:
    """The frontend sizes its admission queue from ``saturation_rps(spec)``: a spec that gives its
    profile as a file (an engine's measured one) is sized from that file, not refused (it was:
    ``load_profile(None)``, and the frontend fell back to 1 req/s)."""
    from easerve_runtime.profiles.capacity import saturation_rps

    slow = _engine_doc()
    slow["engine"]["decode"] = [{"batch": 1, "context_tokens": 2900, "ms": 450.0}, {"batch": 64, "context_tokens": 190000, "ms": 700.0}]
    f = tmp_path / "slow.json"
    f.write_text(json.dumps(slow))
    shipped = saturation_rps(parse_spec(_spec(profile="llava-v1.6-34b@h200")))
    measured = saturation_rps(parse_spec(_spec(profileFile=str(f))))
    assert 0 < measured < shipped  # a 10x slower decode step is a smaller capacity, read from the file


def test_a_cards_mps_constants_in_the_profile_win_over_the_h200s_in_the_twin(tmp_path: Path) -> None:
    """``engine.mps`` (fitted on a card's served runs by ``twin_agreement.py --mps-fit
    --write-profile``) is what the MPS twin charges on that card: a dearer contention and co-run
    slow the same capped run's decode, where a profile without it keeps ``sim.mpsshare``'s own."""
    from easerve_runtime.sim import mpsshare, simulate_system
    from easerve_runtime.sim.events import EventLoop
    from easerve_runtime.sim.latency import StageModel
    from easerve_runtime.workload import generate

    card = {"contention": 0.45, "decode_corun": 1.5, "decode_saturation": 0.4, "fitted_on": "test"}
    plain, fitted = _engine_doc(), _engine_doc()
    fitted["engine"]["mps"] = card
    p = parse_profile_file(fitted)
    # encode_corun and the per-row terms unset: the schema's defaults, none; decode_contention unset: contention's
    assert p.mps_constants == {**{k: card[k] for k in ("contention", "decode_corun", "decode_saturation")},
                               "encode_corun": 0.0, "decode_row_ms": 0.0, "decode_row_extra_ms": 0.0}
    assert parse_profile_file(plain).mps_constants is None
    assert p.corrections is not None and p.corrections.summary()["mps"]["decode_corun"] == 1.5
    one = {"encode/0": frozenset({0}), "decode/0": frozenset({0})}
    m = mpsshare.MPSSharing(EventLoop(), one, {"encode": 0.85}, StageModel(p))
    assert (m.contention, m.decode_corun, m.decode_saturation) == (0.45, 1.5, 0.4)
    assert (m.decode_contention, m.decode_row_ms) == (0.45, 0.0)
    bare = mpsshare.MPSSharing(EventLoop(), one, {"encode": 0.85}, StageModel(parse_profile_file(plain)))
    assert (bare.contention, bare.decode_corun) == (mpsshare.CONTENTION, mpsshare.DECODE_CORUN)
    assert mpsshare.MPSSharing(EventLoop(), one, {}, StageModel(p), contention=0.0).contention == 0.0  # an argument wins
    tpot = {}
    for name, doc in (("plain", plain), ("fitted", fitted)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(doc))
        spec = parse_spec(_spec(profileFile=str(f)))
        reqs = generate(spec, 1.0, 60, 3)
        caps = {"encode": 0.85, "local-prefill": 0.85, "prefill": 0.85}
        tpot[name] = simulate_system(spec, reqs, "easerve", host_gpus=1, mps_caps=caps).summary["tpot"]["p50"]
    assert tpot["fitted"] > tpot["plain"], tpot


@pytest.mark.parametrize(
    ("mps", "expected"),
    [
        ({"contention": -0.1, "decode_corun": 0.0, "decode_saturation": 0.4}, "engine.mps.contention"),
        ({"contention": 0.3, "decode_corun": 0.0, "decode_saturation": 0.0}, "engine.mps.decode_saturation"),
        ({"contention": 0.3, "decode_saturation": 0.4}, "engine.mps.decode_corun: Field required"),
        ({"contention": 0.3, "decode_corun": 0.0, "decode_saturation": 0.4, "bandwidth": 1}, "engine.mps.bandwidth: unknown field"),
        ({"contention": 0.3, "decode_corun": 0.0, "decode_saturation": 0.4, "encode_corun": -0.5}, "engine.mps.encode_corun"),
    ],
)
def test_bad_mps_constants_are_refused_naming_the_field(mps: dict[str, Any], expected: str) -> None:
    doc = _engine_doc()
    doc["engine"]["mps"] = mps
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_profile_file(doc)


def test_the_aggregated_loops_own_costs_in_the_profile_are_what_the_aggregated_twin_charges(tmp_path: Path) -> None:
    """``engine.aggregated`` (read off a served low-load run by ``twin_agreement.py
    --calibrate-aggregated``) multiplies exactly the aggregated replica's encode and prefill charge,
    on the same requests, and a dearer charge lengthens the same run's TTFT; a profile without it
    charges the points as they are, and the disaggregated pipeline does not read it."""
    from easerve_runtime.sim import simulate_system
    from easerve_runtime.workload import generate

    plain, dear = _engine_doc(), _engine_doc()
    dear["engine"]["aggregated"] = {"encode_over_profile": 1.7, "prefill_over_profile": 1.2, "measured_on": "test"}
    p = parse_profile_file(dear)
    assert p.aggregated_loop == {"encode_over_profile": 1.7, "prefill_over_profile": 1.2}
    assert parse_profile_file(plain).aggregated_loop is None
    assert p.corrections is not None and p.corrections.summary()["aggregated"]["prefill_over_profile"] == 1.2
    runs: dict[str, Any] = {}
    for name, doc in (("plain", plain), ("dear", dear)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(doc))
        spec = parse_spec(_spec(profileFile=str(f)))
        reqs = generate(spec, 0.02, 20, 3)  # one request in the loop at a time: the same iterations
        runs[name] = (simulate_system(spec, reqs, "aggregated", layout=(1, 1, 8192)),
                      simulate_system(spec, reqs, "easerve").summary)
    (plain_agg, plain_epd), (dear_agg, dear_epd) = runs["plain"], runs["dear"]
    assert dear_agg.stats["encode_s"] == pytest.approx(1.7 * plain_agg.stats["encode_s"])
    assert dear_agg.stats["prefill_s"] == pytest.approx(1.2 * plain_agg.stats["prefill_s"])
    assert dear_agg.summary["ttft"]["p50"] > plain_agg.summary["ttft"]["p50"]
    assert dear_epd == plain_epd


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ({"encode_over_profile": 0.0, "prefill_over_profile": 1.2}, "engine.aggregated.encode_over_profile"),
        ({"encode_over_profile": 1.7}, "engine.aggregated.prefill_over_profile: Field required"),
        ({"encode_over_profile": 1.7, "prefill_over_profile": 1.2, "decode": 1}, "engine.aggregated.decode: unknown field"),
    ],
)
def test_bad_aggregated_loop_ratios_are_refused_naming_the_field(agg: dict[str, Any], expected: str) -> None:
    doc = _engine_doc()
    doc["engine"]["aggregated"] = agg
    with pytest.raises(ValueError, match=re.escape(expected)):
        parse_profile_file(doc)
