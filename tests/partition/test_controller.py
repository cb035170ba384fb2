"""Controller decisions, backend fallback without a GPU, the CLIs, and the profiler's schema."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from easerve_runtime.partition import backends
from easerve_runtime.partition.controller import ControllerCore, run_loop
from easerve_runtime.partition.profiler import build_table, table_schema_errors
from easerve_runtime.partition.record import (
    ControlRecordFile,
    Demand,
    DemandFile,
    PolicyCode,
    control_path,
    demand_path,
)
from easerve_runtime.policies.partition import BandwidthThrottle, EncodeBatchSplit, PartitionTable

FIX = Path(__file__).parent / "fixtures"


def _issue_table(eps: float = 0.5) -> PartitionTable:
    data = json.loads((FIX / "h200_clip_knee_issue6.json").read_text())
    lat = {int(s): {int(b): ms / 1e3 for b, ms in r.items()} for s, r in data["defaultMs"].items()}
    return PartitionTable.from_latencies(132, lat, epsilon=eps)


def test_core_split_and_idle() -> None:
    t = _issue_table()
    core = ControllerCore(132, split=EncodeBatchSplit(t))
    busy = core.decide(Demand(4, True), Demand(0, True), now=1.0)
    assert busy.policy == PolicyCode.ENCODE_BATCH_SPLIT
    assert busy.primary_sms == t.level_for(4).sms and busy.partner_sms == 132 - busy.primary_sms
    idle = core.decide(Demand(0, False), Demand(0, True), now=2.0)
    assert idle.primary_sms == 0 and idle.partner_sms == 132


def test_core_throttle_static_none() -> None:
    th = BandwidthThrottle((40, 56, 72, 88), 120, 132, b_sat=80)
    core = ControllerCore(132, throttle=th)
    for _ in range(10):
        core.observe(100.0)
    assert core.decide(Demand(2, True), Demand(0, True), 0.0).primary_sms == 88
    assert core.decide(Demand(2, True), Demand(0, False), 0.1).primary_sms == 120
    assert ControllerCore(132, static_sms=64).decide(Demand(1, True), Demand(0, True), 0).partner_sms == 68
    none = ControllerCore(132).decide(Demand(1, True), Demand(0, True), 0)
    assert none.policy == PolicyCode.NONE and none.primary_sms == 132
    with pytest.raises(ValueError, match="policy"):
        ControllerCore(132, static_sms=64, throttle=th)


def test_run_loop_publishes_demand_changes(tmp_path: Path) -> None:
    t = _issue_table()
    ctl = ControlRecordFile(control_path(0, tmp_path), writer=True)
    prim = DemandFile(demand_path(0, "primary", tmp_path), writer=True)
    part = DemandFile(demand_path(0, "partner", tmp_path), writer=True)
    reader = ControlRecordFile(control_path(0, tmp_path))
    script = iter([(1, 100.0), (16, 20.0), (0, 0.0)])
    seen = []
    clock = {"t": 0.0}

    def stop() -> bool:
        if clock["t"] > 0:
            seen.append(reader.read())
        nxt = next(script, None)
        if nxt is None:
            return True
        prim.write(nxt[0], nxt[0] > 0, timestamp=clock["t"])
        part.write(0, True)
        clock["t"] += 1.0
        return False

    samples = iter([10.0, 30.0, 50.0])
    ticks = run_loop(
        ControllerCore(132, split=EncodeBatchSplit(t)),
        ctl,
        prim,
        part,
        lambda: next(samples),
        tick_s=0,
        sample_period_s=0.5,
        stop=stop,
        clock=lambda: clock["t"],
    )
    assert ticks == 3
    assert [r.primary_batch for r in seen] == [1, 16, 0]
    assert [r.primary_sms for r in seen] == [t.level_for(1).sms, t.level_for(16).sms, 0]
    assert seen[-1].partner_sms == 132 and all(r.partner_active for r in seen)
    assert seen[-1].bandwidth_ewma > seen[0].bandwidth_ewma > 0


def test_backend_falls_back_to_none_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "_torch_cuda", lambda: None)
    for pref in ("green-context", "mps", "none"):
        info = backends.detect_backend(pref)
        assert info.name == "none" and "no CUDA GPU" in info.reason and info.total_sms == 0
    with pytest.raises(ValueError, match="smPartition.backend"):
        backends.detect_backend("libsmctrl")
    assert backends.mps_env(66, 132) == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}


def test_profile_partition_cli_without_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from easerve_runtime.cli import profile_partition as cli

    monkeypatch.setattr(backends, "_torch_cuda", lambda: None)
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    rc = cli.run(p.parse_args(["--encoder", "clip-vit-l-336", "--max-batch", "8"]))
    assert rc == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert cli.run(p.parse_args(["--encoder", "resnet"])) == 2
    assert cli.batches_up_to(12) == [1, 2, 4, 8, 12] and cli.batches_up_to(1) == [1]


def test_partition_controller_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from easerve_runtime.cli import partition_controller as cli

    table = tmp_path / "t.json"
    table.write_text(json.dumps(_issue_table().to_dict()))
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    base = [
        "--gpu",
        "5",
        "--shm-dir",
        str(tmp_path),
        "--duration",
        "0.05",
        "--total-sms",
        "132",
        "--tick-ms",
        "1",
    ]
    DemandFile(demand_path(5, "primary", tmp_path), writer=True).write(16, True)
    assert cli.run(p.parse_args([*base, "--policy", "encode-batch-split", "--table", str(table)])) == 0
    rec = ControlRecordFile(control_path(5, tmp_path)).read()
    assert rec.policy == PolicyCode.ENCODE_BATCH_SPLIT and rec.primary_batch == 16
    assert rec.primary_sms == _issue_table().level_for(16).sms
    assert cli.run(p.parse_args([*base, "--policy", "encode-batch-split"])) == 2
    assert "--table" in capsys.readouterr().err
    assert cli.run(p.parse_args([*base, "--policy", "bandwidth-throttle", "--ladder", "40", "88"])) == 0
    assert ControlRecordFile(control_path(5, tmp_path)).read().policy == PolicyCode.BANDWIDTH_THROTTLE
    assert cli.run(p.parse_args([*base, "--policy", "bandwidth-throttle", "--ladder", "40", "132"])) == 2
    assert "s-aggr" in capsys.readouterr().err


def test_profiler_schema() -> None:
    lat = {
        int(s): {int(b): ms / 1e3 for b, ms in r.items()}
        for s, r in json.loads((FIX / "h200_clip_knee_issue6.json").read_text())["defaultMs"].items()
    }
    carve = {s: {b: t * 0.9 for b, t in r.items()} for s, r in lat.items()}
    table, use = build_table(
        lat, carve, 132, 0.1, encoder="clip-vit-l-336", gpu="H200", backend="green-context"
    )
    assert use[132] is False and use[64] is True  # the full GPU never uses a carveout
    data = table.to_dict()
    assert table_schema_errors(data) == []
    broken = dict(data, levels=[{"sms": "64"}])
    assert any(e.startswith("levels[0]") for e in table_schema_errors(broken))
    assert any(e.startswith("totalSMs") for e in table_schema_errors({**data, "totalSMs": "132"}))
    assert any(
        "latencyMs.64" in e
        for e in table_schema_errors({**data, "latencyMs": {**data["latencyMs"], "64": {"1": -1}}})
    )


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("partition_table_*.json")))
def test_device_tables_validate(name: str) -> None:
    """Tables produced on the H200 by benchmarks/partition_bench.py, committed as fixtures."""
    data = json.loads((FIX / name).read_text())
    assert table_schema_errors(data) == []
    t = PartitionTable.from_dict(data)
    assert t.ladder[-1] == t.total_sms
    assert all(lv.sms % 8 == 0 for lv in t.levels[:-1])
