"""The pure SM-partition policies, driven by measured H200 tables and an NVML signal trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from easerve_runtime.policies.partition import (
    BandwidthThrottle,
    EncodeBatchSplit,
    Ewma,
    PartitionLevel,
    PartitionTable,
    align_sms,
    default_ladder,
    snap,
)

FIX = Path(__file__).parent / "fixtures"


def _table(key: str, epsilon: float) -> PartitionTable:
    data = json.loads((FIX / "h200_clip_knee_issue6.json").read_text())
    lat = {int(s): {int(b): ms / 1e3 for b, ms in row.items()} for s, row in data[key].items()}
    return PartitionTable.from_latencies(data["totalSMs"], lat, epsilon=epsilon, encoder="clip-vit-l-336")


def test_table_from_measured_carveout_profile() -> None:
    t = _table("carveoutMs", 0.10)
    got = {lv.sms: lv.max_batch for lv in t.levels}
    # 128 SMs: 2.19/2.08=1.05, 4.61/4.51=1.02, 16.36/15.73=1.04 -> all within 10%
    assert got[128] == 16
    # 96 SMs: b1 2.21/2.08=1.06 ok, b4 5.47/4.51=1.21 too slow -> 1
    assert got[96] == 1
    # 64 SMs: b1 2.63/2.08=1.26 -> nothing
    assert got[64] == 0 and got[16] == 0
    assert got[132] == 16


def test_epsilon_widens_coverage_monotonically() -> None:
    prev = None
    for eps in (0.05, 0.1, 0.3, 0.6, 1.0):
        t = _table("defaultMs", eps)
        cover = [lv.max_batch for lv in t.levels]
        if prev is not None:
            assert all(c >= p for c, p in zip(cover, prev, strict=True))
        prev = cover


def test_coverage_is_prefix_monotone() -> None:
    # a level slow at batch 4 is not trusted at 16 even if 16 happens to be close
    lat = {132: {1: 1.0, 4: 2.0, 16: 8.0}, 64: {1: 1.05, 4: 3.0, 16: 8.1}}
    t = PartitionTable.from_latencies(132, lat, epsilon=0.1)
    assert t.levels[0] == PartitionLevel(64, 1)


def test_split_picks_smallest_covering_level_and_complement() -> None:
    t = _table("defaultMs", 0.5)
    pol = EncodeBatchSplit(t)
    for batch in (1, 2, 4, 8, 16, 64):
        s = pol.decide(batch)
        assert s.primary_sms + s.partner_sms == 132
        lv = t.levels[s.level]
        assert lv.sms == s.primary_sms
        covering = [x.sms for x in t.levels if x.max_batch >= batch]
        assert s.primary_sms == (min(covering) if covering else 132)
    # bigger batches never get fewer SMs
    sms = [pol.decide(b).primary_sms for b in range(1, 40)]
    assert sms == sorted(sms)
    assert pol.decide(1).primary_sms < pol.decide(16).primary_sms
    assert pol.idle().partner_sms == 132


def test_table_json_roundtrip_and_errors() -> None:
    t = _table("defaultMs", 0.1)
    back = PartitionTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.levels == t.levels and back.total_sms == 132 and back.encoder == "clip-vit-l-336"
    assert back.latency_s[64][4] == pytest.approx(t.latency_s[64][4])
    bad = t.to_dict()
    bad["schemaVersion"] = 99
    with pytest.raises(ValueError, match="schemaVersion"):
        PartitionTable.from_dict(bad)
    bad = t.to_dict()
    del bad["levels"][0]["maxBatch"]
    with pytest.raises(ValueError, match="levels"):
        PartitionTable.from_dict(bad)
    with pytest.raises(ValueError, match="full GPU"):
        PartitionTable(total_sms=132, levels=(PartitionLevel(64, 1),))
    with pytest.raises(ValueError, match="full-GPU"):
        PartitionTable.from_latencies(132, {64: {1: 1.0}})


def test_ladder_helpers() -> None:
    assert align_sms(70, 132) == 64 and align_sms(3, 132) == 8 and align_sms(200, 132) == 132
    lad = default_ladder(132, 5)
    assert lad[-1] == 132 and len(lad) == 5 and all(s % 8 == 0 for s in lad[:-1])
    assert snap(70, (32, 64, 96)) == 64 and snap(80, (32, 64, 96)) == 96  # tie goes up
    e = Ewma(0.4)
    assert e.update(10) == 10 and e.update(20) == pytest.approx(14.0)


def _trace() -> list[dict[str, object]]:
    """NVML memory activity recorded on the H200 (idle / encoder / copy / encoder+copy / idle)."""
    return json.loads((FIX / "nvml_memory_trace_h200.json").read_text())["samples"]


def _run_throttle(step: float | None = None) -> tuple[BandwidthThrottle, list[tuple[str, bool, int, float]]]:
    th = BandwidthThrottle(ladder=(40, 56, 72, 88), s_aggr=120, total_sms=132, b_sat=80.0, step=step)
    out = []
    for s in _trace():
        active = bool(s["downstreamActive"])
        th.observe(float(s["memory"]))  # type: ignore[arg-type]
        d = th.decide(active, now=float(s["t"]))  # type: ignore[arg-type]
        assert d.primary_sms + d.partner_sms == 132
        out.append((str(s["phase"]), active, d.primary_sms, th.target(active)))
    return th, out


def test_throttle_follows_eq1_on_recorded_trace() -> None:
    th, out = _run_throttle()
    for _, active, sms, raw in out:
        if not active:
            assert sms == 120  # S_aggr
        else:
            assert 40 <= sms <= 88 and sms in th.ladder  # bounded ladder, never full allocation
            assert abs(sms - raw) < th.step + 1e-9  # within one ladder step of Eq. 1's target
    copy = [sms for phase, _, sms, _ in out if phase == "copy"]
    assert copy[-1] == 88  # the D2D copy saturates memory activity: rho -> 1 -> S_cap
    both = [sms for phase, _, sms, _ in out if phase == "encoder+copy"]
    assert both[-1] < copy[-1]  # lower pressure once the encoder shares the bus: the cap comes down
    assert any(a for _, a, _, _ in out) and any(not a for _, a, _, _ in out)


def test_throttle_hysteresis_limits_changes() -> None:
    _, out = _run_throttle()
    changes = sum(1 for a, b in zip(out, out[1:], strict=False) if a[2] != b[2])
    # a plain snap of the raw target flips between neighbours whenever it sits near a midpoint
    raw_snaps = [snap(raw, (40, 56, 72, 88)) if act else 120 for _, act, _, raw in out]
    raw_changes = sum(1 for a, b in zip(raw_snaps, raw_snaps[1:], strict=False) if a != b)
    assert changes <= raw_changes
    _, coarse = _run_throttle(step=32)
    coarse_changes = sum(1 for a, b in zip(coarse, coarse[1:], strict=False) if a[2] != b[2])
    assert coarse_changes <= changes  # a wider hysteresis band never changes the cap more often


def test_throttle_validation() -> None:
    with pytest.raises(ValueError, match="s_aggr"):
        BandwidthThrottle(ladder=(40, 88), s_aggr=88, total_sms=132, b_sat=50)
    with pytest.raises(ValueError, match="b_sat"):
        BandwidthThrottle(ladder=(40, 88), s_aggr=120, total_sms=132, b_sat=0)
    with pytest.raises(ValueError, match="ladder"):
        BandwidthThrottle(ladder=(), s_aggr=120, total_sms=132, b_sat=50)
    th = BandwidthThrottle(ladder=(40, 88), s_aggr=132, total_sms=132, b_sat=50)
    assert th.decide(False, 0.0).primary_sms == 132
    assert th.decide(True, 0.1).primary_sms == 40  # no samples yet: rho = 0
    assert th.changed_at == 0.1
