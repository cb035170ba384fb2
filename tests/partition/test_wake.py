"""The tenants wake the partition controller (``partition/wake.py``) instead of it polling.

Why it matters: a polling controller cost 8.5 % of a core per idle encode GPU on the 2-core host
(0.2-0.3 % now, docs/benchmarks.md) and answered late on a loaded one. These tests show the
controller sleeping until a demand is written and answering that demand, the datagrams
collapsing, and both ends degrading (no listener, a path too long for a socket) without an error.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from easerve_runtime.partition.controller import ControllerCore, run_loop
from easerve_runtime.partition.record import ControlRecordFile, DemandFile, control_path, demand_path
from easerve_runtime.partition.wake import WakeListener, WakeSender, wake_path
from easerve_runtime.policies.partition import BandwidthThrottle, EncodeBatchSplit, PartitionTable
from easerve_runtime.workers.partition_link import PartitionLink


@pytest.fixture
def shm() -> Iterator[Path]:
    """A short directory: a socket path must fit ``sun_path`` (108 bytes), pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="eaw", dir="/tmp") as d:
        yield Path(d)


def table() -> PartitionTable:
    lat = {s: {b: 0.004 * b * 132 / s for b in (1, 2, 4, 8, 16)} for s in (32, 64, 96, 132)}
    return PartitionTable.from_latencies(132, lat, epsilon=0.5)


def test_pokes_wake_the_listener_and_collapse_into_one(shm: Path) -> None:
    path = wake_path(control_path(0, shm))
    assert path.name == "easerve-partition-gpu0.wake"
    listener = WakeListener.bind(path)
    assert listener is not None
    sender = WakeSender(path)
    assert listener.wait(0) is False  # nothing sent: a timeout
    assert [sender.poke() for _ in range(3)] == [True, True, True]
    assert listener.wait(5.0) is True
    assert listener.wait(0) is False  # the three were drained by one wake-up
    listener.close()
    assert not path.exists()
    assert sender.poke() is False  # the controller is gone: the tenant carries on
    assert sender.sent == 3


def test_a_stale_socket_is_replaced_and_a_path_too_long_degrades_to_polling(shm: Path) -> None:
    path = shm / "x.wake"
    first = WakeListener.bind(path)
    assert first is not None
    first.sock.close()  # a controller that died and left its socket file
    second = WakeListener.bind(path)
    assert second is not None
    assert WakeSender(path).poke() is True and second.wait(5.0) is True
    second.close()
    deep = shm / ("d" * 120) / "x.wake"
    deep.parent.mkdir()
    assert WakeListener.bind(deep) is None  # the controller then polls
    sender = WakeSender(deep)
    assert sender.poke() is False and sender.sock is None  # disabled once, never raises


def test_the_controller_sleeps_until_a_demand_is_written_and_answers_it(shm: Path) -> None:
    """The controller waits 60 s between decisions unless poked; the encoder's link waits up to
    30 s for a record that answers its batch. The answer comes only because the link's demand
    write woke the controller: a polling-free run, counted in decisions, not timed."""
    t = table()
    control = ControlRecordFile(control_path(0, shm), writer=True)
    prim = DemandFile(demand_path(0, "primary", shm), writer=True)
    part = DemandFile(demand_path(0, "partner", shm), writer=True)
    prim.close()
    part.close()
    listener = WakeListener.bind(wake_path(control.path))
    assert listener is not None
    stopping = threading.Event()
    result: dict[str, int] = {}

    def controller() -> None:
        result["decisions"] = run_loop(
            ControllerCore(132, split=EncodeBatchSplit(t)), control,
            DemandFile(demand_path(0, "primary", shm)), DemandFile(demand_path(0, "partner", shm)),
            None, stop=stopping.is_set, wake=listener.wait, idle_wait_s=60.0)

    th = threading.Thread(target=controller, daemon=True)
    th.start()
    link = PartitionLink(0, "primary", shm, settle_s=30.0)
    while not control.path.exists() or ControlRecordFile(control.path).read().seq == 0:
        threading.Event().wait(0.01)  # the controller's first decision (idle) is published
    share = link.share(16)
    assert link.last is not None and link.last.primary_batch == 16  # the controller answered this batch
    assert share == pytest.approx(t.level_for(16).sms / 132)
    link.idle()
    stopping.set()
    WakeSender(wake_path(control.path)).poke()  # wake it to see the stop
    th.join(30.0)
    assert not th.is_alive()
    # the first decision, one per poke that found new demand, and the stop: no polling in between
    assert 2 <= result["decisions"] <= 5
    listener.close()
    link.close()


def test_the_wait_asked_for_follows_the_policy_and_the_nvml_cadence(shm: Path) -> None:
    """Demand-driven policies sleep until poked (``idle_wait_s``), also while a tenant runs; the
    bandwidth throttle, whose decision moves with time, keeps its tick while a tenant runs; an
    NVML sampler shortens any wait to its next sample."""
    control = ControlRecordFile(control_path(0, shm), writer=True)
    prim = DemandFile(demand_path(0, "primary", shm), writer=True)
    part = DemandFile(demand_path(0, "partner", shm), writer=True)
    prim.write(4, True)
    part.write(0, True)

    def waits(core: ControllerCore, sample: object = None) -> list[float]:
        asked: list[float] = []
        clock = {"t": 0.0}

        def wake(timeout: float) -> bool:
            asked.append(round(timeout, 6))
            clock["t"] += 0.001
            return False

        run_loop(core, control, prim, part, sample, tick_s=0.0005, sample_period_s=0.02,  # type: ignore[arg-type]
                 stop=lambda: len(asked) >= 2, clock=lambda: clock["t"], wake=wake, idle_wait_s=0.1)
        return asked

    assert waits(ControllerCore(132, split=EncodeBatchSplit(table()))) == [0.1, 0.1]
    assert waits(ControllerCore(132, static_sms=64)) == [0.1, 0.1]
    th = BandwidthThrottle((40, 56, 72, 88), 120, 132, b_sat=80)
    assert waits(ControllerCore(132, throttle=th)) == [0.0005, 0.0005]
    part.write(0, False)
    prim.write(0, False)
    assert waits(ControllerCore(132, throttle=th)) == [0.1, 0.1]  # nothing runs: nothing to follow
    assert waits(ControllerCore(132, static_sms=64), sample=lambda: 10.0) == [0.02, 0.019]


def test_a_partner_waiting_for_sms_is_woken_by_the_controller_not_by_re_reading(
        shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local prefill (partner) waits while its encoder's micro-batch holds every SM. It used to
    re-read the record every 0.5 ms; now it sleeps until the controller, publishing the split that
    grants it SMs (the encoder went idle), pokes it. Its re-read safety net is set to 60 s here, so
    only the poke can end the wait within the 30 s the test allows."""
    import asyncio

    from easerve_runtime.partition.wake import tenant_wake_path
    from easerve_runtime.workers import partition_link

    monkeypatch.setattr(partition_link, "PARTNER_RECHECK_S", 60.0)
    # an encoder that needs the whole GPU to stay within 10 % of its best latency
    t = PartitionTable.from_latencies(
        132, {s: {b: 0.004 * b * (132 / s) ** 3 for b in (1, 2, 4, 8, 16)} for s in (32, 64, 96, 132)}, epsilon=0.1)
    assert t.level_for(16).sms == 132  # a batch of 16 takes the whole GPU: the partner gets none
    control = ControlRecordFile(control_path(0, shm), writer=True)
    for role in ("primary", "partner"):
        DemandFile(demand_path(0, role, shm), writer=True).close()
    listener = WakeListener.bind(wake_path(control.path))
    assert listener is not None
    tenants = [WakeSender(tenant_wake_path(control.path, r)) for r in ("primary", "partner")]
    stopping = threading.Event()

    def controller() -> None:
        run_loop(ControllerCore(132, split=EncodeBatchSplit(t)), control,
                 DemandFile(demand_path(0, "primary", shm)), DemandFile(demand_path(0, "partner", shm)),
                 None, stop=stopping.is_set, wake=listener.wait, idle_wait_s=60.0,
                 published=lambda: [s.poke() for s in tenants] and None)

    th = threading.Thread(target=controller, daemon=True)
    th.start()
    encoder = PartitionLink(0, "primary", shm, settle_s=30.0)
    prefill = PartitionLink(0, "partner", shm)
    assert encoder._woken is not None and prefill._woken is not None
    while not control.path.exists() or ControlRecordFile(control.path).read().seq == 0:
        threading.Event().wait(0.01)
    assert encoder.share(16) == 1.0  # answered by a poke too: the settle wait is 30 s

    async def run() -> float:
        waiting = asyncio.create_task(prefill.granted(4, max_wait_s=60.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no SMs for it while the micro-batch runs
        encoder.idle()  # the micro-batch ends: the controller grants the partner the GPU and pokes
        return await asyncio.wait_for(waiting, 30.0)

    share = asyncio.run(run())
    assert share == 1.0 and prefill.last is not None and prefill.last.partner_sms == 132
    assert prefill.ungranted == 0  # granted, not the whole-GPU fallback
    stopping.set()
    WakeSender(wake_path(control.path)).poke()
    th.join(30.0)
    assert not th.is_alive()
    for x in (encoder, prefill):
        x.close()
    listener.close()
    assert not tenant_wake_path(control.path, "partner").exists()  # the tenant removed its socket
