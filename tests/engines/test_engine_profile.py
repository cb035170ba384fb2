"""``easerve profile --engine torch``: the tiny LLaVA-NeXT on the CPU, measured stage by stage
through the real engines, written as a profile file that the twin then reads back.

What is asserted is the chain, not any speed: the file validates, names the model's exact
backbone (read from its config), and the profile built from it reproduces each measured stage
time at the points it measured; a spec pointed at it runs in the twin."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from easerve_operator.cli import main
from easerve_runtime.profiles import load_profile_file

pytestmark = pytest.mark.slow


def _manifest(tmp_path: Path, model: Path, backend: str = "torch", **engine: str) -> Path:
    doc = {
        "apiVersion": "easerve.io/v1alpha1", "kind": "EPDDeployment", "metadata": {"name": "tiny-torch"},
        "spec": {
            "model": {"name": "tiny-llava-next", "modality": "image", "encoder": "clip-vit-l-336", "path": str(model)},
            "engine": {"backend": backend, **(engine or {"profile": "llava-v1.6-34b@h200"})},
            "decode": {"kvMemoryFraction": 0.01},
            "gpuBudget": 3,
            "allocation": {"encode": {"replicas": 1}, "prefill": {"replicas": 1}, "decode": {"replicas": 1}},
            "encode": {"batchBound": 4, "dispatch": "eager"},
            "offload": {"ratio": 0.5},
            "slo": {"objective": "m", "tiers": [{"name": "m", "ttftSeconds": 30, "tpotMs": 1000}]},
            "discovery": {"backend": "file"},
        },
    }
    f = tmp_path / f"{backend}-{len(engine)}.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_profile_measures_the_engine_and_the_twin_reads_it(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EASERVE_DEVICE", "cpu")
    model = model_dirs["llava-next"]
    out = tmp_path / "measured.json"
    rc = main(["profile", "--engine", "torch", "-f", str(_manifest(tmp_path, model)), "-o", str(out),
               "--encode-batches", "1,4", "--decode-batches", "1,3", "--requests", "4", "--reps", "2",
               "--image-format", "jpeg"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["profile"] == "tiny-llava-next@h200" and report["path"] == str(out)

    doc = json.loads(out.read_text())
    cfg = json.loads((model / "config.json").read_text())["text_config"]
    bb = doc["models"]["backbones"]["tiny-llava-next-backbone"]
    assert (bb["layers"], bb["hidden"], bb["vocab"]) == (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"])
    eng = doc["engine"]
    assert eng["engine"] == "torch" and eng["device"] == "cpu" and "jpeg images" in doc["_doc"]
    assert len(eng["encode"]) == 2 and len(eng["prefill"]) == 4 and [p["batch"] for p in eng["decode"]] == [1, 3]

    prof = load_profile_file(out)
    assert prof.name == "tiny-llava-next@h200" and prof.backbone.layers == cfg["num_hidden_layers"]
    by_items: dict[int, list[float]] = {}
    for p in eng["encode"]:
        by_items.setdefault(p["items"], []).append(p["ms"])
    for items, ms in by_items.items():
        assert prof.encode_s(items) * 1e3 == pytest.approx(statistics.median(ms))
    by_tokens: dict[int, list[float]] = {}
    for p in eng["prefill"]:
        by_tokens.setdefault(p["tokens"], []).append(p["ms"])
    for tokens, ms in by_tokens.items():
        assert prof.prefill_s(tokens) * 1e3 == pytest.approx(statistics.median(ms))
    for p in eng["decode"]:
        assert prof.decode_step_s(p["batch"], p["context_tokens"]) * 1e3 == pytest.approx(p["ms"])
        assert p["context_tokens"] >= p["batch"] * max(by_tokens)  # a real prefilled cache, grown by the steps

    sim = _manifest(tmp_path, model, backend="sim", profileFile=str(out))
    assert main(["sim", "-f", str(sim), "--requests", "20", "--rate", "1", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["profile"] == "tiny-llava-next@h200" and run["completed"] == 20


def test_profile_refuses_a_spec_without_a_torch_model(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = _manifest(tmp_path, model_dirs["llava-next"], backend="sim")
    assert main(["profile", "--engine", "torch", "-f", str(sim), "-o", str(tmp_path / "p.json")]) == 2
    assert "spec.engine.backend must be torch" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_profile_names_the_field_of_an_invalid_spec(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _manifest(tmp_path, model_dirs["llava-next"])
    doc = yaml.safe_load(f.read_text())
    doc["spec"]["encode"]["batchBound"] = 0
    f.write_text(yaml.safe_dump(doc))
    assert main(["profile", "--engine", "torch", "-f", str(f), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"easerve profile: {f}: invalid spec: spec.encode.batchBound:" in err, err
    assert not (tmp_path / "p.json").exists()
