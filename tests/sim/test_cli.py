"""`easerve sim`: JSON fields, determinism, trace replay, errors naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import EXAMPLES
from easerve_operator.cli import main
from easerve_runtime.workload import generate, write_trace

pytest.importorskip("easerve_runtime.profiles", reason="latency profiles not installed")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["sim", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_has_the_listed_fields(capsys) -> None:
    rc, out, _ = run_cli(
        capsys,
        "-f",
        str(EXAMPLES["llava-v1.6-34b"]),
        "--rate",
        "2",
        "--requests",
        "60",
        "--seed",
        "1",
        "--json",
    )
    assert rc == 0
    d = json.loads(out)
    for k in (
        "throughput",
        "goodput",
        "ttft",
        "tpot",
        "completed",
        "failed",
        "utilisation",
        "dispatch_reasons",
        "routed",
    ):
        assert k in d
    assert set(d["goodput"]) == {"strict", "tight", "moderate", "loose", "relaxed"}
    assert set(d["ttft"]) >= {"mean", "p99"} and set(d["tpot"]) >= {"mean", "p99"}
    assert d["completed"] == 60 and d["failed"] == 0
    assert d["goodput"]["strict"] <= d["goodput"]["relaxed"]


def test_all_systems_and_ratios(capsys) -> None:
    rc, out, _ = run_cli(
        capsys,
        "-f",
        str(EXAMPLES["qwen2.5-vl-32b"]),
        "--rate",
        "2",
        "--requests",
        "40",
        "--system",
        "all",
        "--json",
    )
    assert rc == 0
    d = json.loads(out)
    assert set(d["systems"]) == {"dynamo", "aggregated", "easerve-s1", "easerve"}
    assert set(d["ratios"]) == {"easerve/dynamo", "easerve/aggregated", "easerve/easerve-s1"}
    assert d["systems"]["dynamo"]["config"]["batch_bound"] == 1
    assert len(d["systems"]["dynamo"]["swept"]) > 1  # a real sweep
    # the ratios compare an untuned spec with oracle-tuned baselines, and say so
    assert d["ratio_basis"]["easerve"].startswith("untuned")
    assert d["ratio_basis"]["dynamo"].startswith("oracle-tuned: best of")
    assert d["ratio_basis"]["aggregated"].startswith("oracle-tuned")


def test_seeded_cli_runs_are_identical_and_gamma_differs(capsys) -> None:
    args = ["-f", str(EXAMPLES["qwen2.5-vl-32b"]), "--rate", "2", "--requests", "50", "--seed", "3", "--json"]
    a = json.loads(run_cli(capsys, *args)[1])
    b = json.loads(run_cli(capsys, *args)[1])
    a.pop("cpu_s"), b.pop("cpu_s")
    assert a == b
    c = json.loads(run_cli(capsys, *args, "--arrival", "gamma", "--cv", "2")[1])
    assert c["arrival"] == "gamma" and c["ttft"] != a["ttft"]


def test_trace_replay_matches_generated(tmp_path: Path, capsys) -> None:
    from easerve_runtime.api import load_manifest

    spec = load_manifest(EXAMPLES["llava-v1.6-34b"])[1]
    p = tmp_path / "t.jsonl"
    write_trace(p, generate(spec, 2.0, 40, 5))
    gen = json.loads(
        run_cli(
            capsys,
            "-f",
            str(EXAMPLES["llava-v1.6-34b"]),
            "--rate",
            "2",
            "--requests",
            "40",
            "--seed",
            "5",
            "--json",
        )[1]
    )
    rep = json.loads(run_cli(capsys, "-f", str(EXAMPLES["llava-v1.6-34b"]), "--trace", str(p), "--json")[1])
    assert rep["throughput"] == gen["throughput"] and rep["goodput"] == gen["goodput"]


def test_errors_name_the_field(tmp_path: Path, capsys) -> None:
    rc, _, err = run_cli(capsys, "-f", str(EXAMPLES["llava-v1.6-34b"]), "--rate", "0", "--json")
    assert rc == 2 and "--rate" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "arrival_s": 0, "modality": "image", "colour": 1}\n')
    rc, _, err = run_cli(capsys, "-f", str(EXAMPLES["llava-v1.6-34b"]), "--trace", str(bad), "--json")
    assert rc == 2 and "colour" in err and ":1:" in err
    y = tmp_path / "spec.yaml"
    y.write_text(EXAMPLES["llava-v1.6-34b"].read_text().replace("batchBound: 8", "batchBound: 0"))
    rc, _, err = run_cli(capsys, "-f", str(y), "--json")
    assert rc == 2 and "spec.encode.batchBound" in err


def test_infeasible_local_prefill_is_an_error_not_ignored(tmp_path: Path, capsys) -> None:
    """A 27B backbone needs 2 GPUs on a 48 GB card: one encode GPU cannot host local prefill."""
    y = tmp_path / "one-encoder.yaml"
    text = re.sub(
        r"encode: \{replicas: \d+", "encode: {replicas: 1", EXAMPLES["ultravox-v0.6-27b"].read_text()
    )
    y.write_text(text.replace("ratio: 1.0", "ratio: 0.5"))
    rc, _, err = run_cli(capsys, "-f", str(y), "--requests", "20", "--json")
    assert rc == 2 and "spec.offload.ratio" in err and "TP2" in err


def test_omni_specs_are_delegated_to_sim_omni(capsys) -> None:
    omni = EXAMPLES["llava-v1.6-34b"].parent / "qwen2.5-omni.yaml"
    if not omni.exists():
        pytest.skip("no omni example in this checkout")
    pytest.importorskip("easerve_runtime.sim.omni", reason="sim.omni not built")
    rc, out, _ = run_cli(capsys, "-f", str(omni), "--requests", "20", "--seed", "1", "--json")
    assert rc == 0
    assert "per_class" in json.loads(out)  # the omni twin's report, not the EPD one
