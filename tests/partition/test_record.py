"""The /dev/shm control record: layout round trip, and no torn reads under a concurrent writer."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from easerve_runtime.partition.record import (
    CONTROL_SIZE,
    ControlRecord,
    ControlRecordFile,
    DemandFile,
    PolicyCode,
    control_path,
    demand_path,
)


def test_roundtrip(tmp_path: Path) -> None:
    p = control_path(3, tmp_path)
    w = ControlRecordFile(p, writer=True)
    r = ControlRecordFile(p)
    assert p.stat().st_size == CONTROL_SIZE == 64
    rec = ControlRecord(
        40,
        92,
        132,
        PolicyCode.BANDWIDTH_THROTTLE,
        2,
        primary_batch=5,
        bandwidth_ewma=37.5,
        downstream_active=True,
        partner_active=True,
        timestamp=12.25,
    )
    seq = w.write(rec)
    got = r.read()
    assert got.seq == seq and seq % 2 == 0
    assert (got.primary_sms, got.partner_sms, got.total_sms, got.policy, got.level) == (
        40,
        92,
        132,
        PolicyCode.BANDWIDTH_THROTTLE,
        2,
    )
    assert (
        got.bandwidth_ewma == 37.5 and got.downstream_active and got.partner_active and got.timestamp == 12.25
    )
    assert got.primary_batch == 5
    with pytest.raises(PermissionError):
        r.write(rec)
    with pytest.raises(ValueError, match="exceeds total_sms"):
        w.write(ControlRecord(100, 100, 132, PolicyCode.STATIC, 0))


def test_reader_rejects_foreign_file(tmp_path: Path) -> None:
    p = tmp_path / "junk"
    p.write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match="magic"):
        ControlRecordFile(p)
    with pytest.raises(ValueError, match="role"):
        demand_path(0, "decode", tmp_path)


def test_writer_recovers_from_crash_mid_update(tmp_path: Path) -> None:
    p = control_path(0, tmp_path)
    w = ControlRecordFile(p, writer=True)
    w.write(ControlRecord(64, 68, 132, PolicyCode.STATIC, 0))
    w._lock._mm[8] = w._lock._mm[8] | 1  # leave seq odd, as a writer killed mid-update would
    w.close()
    w2 = ControlRecordFile(p, writer=True)  # a restarted controller makes it readable again
    assert ControlRecordFile(p).read().primary_sms == 64
    w2.close()


def _writer(path: str, n: int) -> None:
    w = ControlRecordFile(Path(path), writer=True)
    for k in range(1, n + 1):
        prim = 8 * (k % 16 + 1)
        # every field derives from k, so a mix of two writes breaks an invariant
        w.write(
            ControlRecord(
                prim,
                132 - prim,
                132,
                PolicyCode(k % 4),
                k % 1000,
                primary_batch=k % 100_000,
                bandwidth_ewma=float(k),
                downstream_active=bool(k % 2),
                partner_active=bool(k % 2),
                timestamp=float(k) * 2,
            )
        )


def _reader(path: str, n: int, q: mp.Queue) -> None:
    r = ControlRecordFile(Path(path))
    bad = seen = 0
    last = 0
    while seen < n:
        rec = r.read()
        k = int(rec.bandwidth_ewma)
        if k == 0:
            continue
        ok = (
            rec.primary_sms == 8 * (k % 16 + 1)
            and rec.primary_sms + rec.partner_sms == 132
            and rec.policy == k % 4
            and rec.level == k % 1000
            and rec.primary_batch == k % 100_000
            and rec.downstream_active == bool(k % 2) == rec.partner_active
            and rec.timestamp == k * 2.0
            and k >= last
        )
        bad += not ok
        last = k
        seen += 1
    q.put((seen, bad))


def test_concurrent_writer_and_readers_never_see_a_torn_record(tmp_path: Path) -> None:
    path = str(control_path(0, tmp_path))
    ControlRecordFile(Path(path), writer=True).close()
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(path, 20_000, q)) for _ in range(2)]
    for p in readers:
        p.start()
    w = ctx.Process(target=_writer, args=(path, 150_000))
    w.start()
    w.join(60)
    results = [q.get(timeout=60) for _ in readers]
    for p in readers:
        p.join(10)
    assert w.exitcode == 0
    for seen, bad in results:
        assert seen == 20_000 and bad == 0


def test_demand_file(tmp_path: Path) -> None:
    p = demand_path(0, "primary", tmp_path)
    w = DemandFile(p, writer=True)
    w.write(7, True, timestamp=3.0)
    d = DemandFile(p).read()
    assert (d.batch, d.active, d.timestamp) == (7, True, 3.0)
    with pytest.raises(ValueError, match="batch"):
        w.write(-1, False)
