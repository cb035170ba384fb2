"""The omni twin and profiles: every request is served, the CLI shape, the contention model's order."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from easerve_runtime.api import load_manifest
from easerve_runtime.omni.profile import Sharing, available, load_omni_profile
from easerve_runtime.policies.omni import class_table
from easerve_runtime.sim.omni import SYSTEMS, make_workload, run_cli, simulate, slo_table

EXAMPLE = Path(__file__).parents[2] / "examples" / "qwen2.5-omni.yaml"


def test_three_profiles_ship() -> None:
    assert {"qwen2.5-omni-7b@h200", "mimo-audio-7b@h200", "bagel-7b@h200"} <= set(available())
    with pytest.raises(ValueError, match="spec.engine.profile"):
        load_omni_profile("nope@h200")


def test_contention_order_matches_the_paper() -> None:
    """Co-running: a bounded green split hurts the shared stage least, full allocation hurts the downstream."""
    p = load_omni_profile("qwen2.5-omni-7b@h200")
    green_cap = p.slowdown(Sharing.GREEN, 72, True, True)[0]
    mps = p.slowdown(Sharing.MPS, 132, True, True)[0]
    ts = p.slowdown(Sharing.TIMESLICE, 132, True, True)[0]
    assert 1.0 <= green_cap < mps < ts
    assert p.slowdown(Sharing.GREEN, 132, True, True)[1] > p.slowdown(Sharing.GREEN, 72, True, True)[1]
    for s in Sharing:  # alone, nothing slows down
        assert p.slowdown(s, 132, True, False)[0] == pytest.approx(1.0)


def test_every_system_serves_every_request_and_solo_slo_orders_classes() -> None:
    _, spec = load_manifest(EXAMPLE)
    assert spec.omni is not None
    prof = load_omni_profile(spec.engine.profile)
    slo = slo_table(prof, spec.omni)
    audio_over_text = slo.seconds("audio") / slo.seconds("text")
    assert audio_over_text > 10  # orders of magnitude apart, as in §3.1
    wl = make_workload(prof, class_table(spec.omni.classes), 12.0, 200, 3)
    for system in SYSTEMS:
        res = simulate(prof, spec.omni, slo, system, wl)
        assert len(res.jobs) == 200 and all(j.first_response is not None for j in res.jobs), system
        assert all(j.done is not None for j in res.jobs), system
        out = res.summary()
        assert 0.0 <= out["slo_attainment"] <= 1.0
        assert set(out["per_class"]) == {"text", "audio"}


def test_run_cli_prints_json_with_per_class(capsys: pytest.CaptureFixture[str]) -> None:
    name, spec = load_manifest(EXAMPLE)
    args = argparse.Namespace(
        policy="edf-mps", rate=8.0, long_path_ratio=0.4, requests=120, seed=1, json=True
    )
    assert run_cli(name, spec, args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["system"] == "edf-mps" and out["requests"] == 120
    assert set(out["per_class"]) == {"text", "audio"}
    for d in out["per_class"].values():
        assert {"attainment", "p95_s", "slo_s"} <= set(d)
    args.policy = "nope"
    assert run_cli(name, spec, args) == 2
