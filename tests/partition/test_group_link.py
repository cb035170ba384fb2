"""A local prefill worker spanning k encode GPUs reads every GPU's record and runs at the smallest share."""

from __future__ import annotations

from pathlib import Path

from easerve_runtime.partition.record import (
    ControlRecord,
    ControlRecordFile,
    DemandFile,
    PolicyCode,
    control_path,
    demand_path,
)
from easerve_runtime.workers.partition_link import PartitionGroupLink


def _publish(shm: Path, gpu: int, partner_sms: int, total: int = 100) -> ControlRecordFile:
    rec = ControlRecordFile(control_path(gpu, shm), writer=True)
    rec.write(ControlRecord(total - partner_sms, partner_sms, total, PolicyCode.STATIC, level=0))
    return rec


def test_share_is_the_smallest_granted_and_demand_goes_to_every_gpu(tmp_path: Path) -> None:
    link = PartitionGroupLink([0, 1], "partner", tmp_path)
    assert link.share(3) == 1.0  # no controller yet: the whole GPUs
    writers = [_publish(tmp_path, 0, 40), _publish(tmp_path, 1, 25)]
    assert link.share(3) == 0.25  # a TP step advances at its slowest rank's pace
    for gpu in (0, 1):  # both controllers see the partner's demand
        d = DemandFile(demand_path(gpu, "partner", tmp_path)).read()
        assert (d.batch, d.active) == (3, True)
    link.idle()
    assert all(not DemandFile(demand_path(g, "partner", tmp_path)).read().active for g in (0, 1))
    assert link.last is not None and link.last.partner_sms == 40
    link.close()
    for w in writers:
        w.close()


def test_an_encoder_never_runs_on_the_idle_split_of_a_lagging_or_dead_controller(tmp_path: Path) -> None:
    """The idle split gives encode 0 SMs; a controller that has not answered the batch (or died
    leaving that split) must not starve the encoder: it falls back to the whole GPU."""
    from easerve_runtime.workers.partition_link import PartitionLink

    rec = ControlRecordFile(control_path(0, tmp_path), writer=True)
    rec.write(ControlRecord(0, 132, 132, PolicyCode.ENCODE_BATCH_SPLIT, level=0, primary_batch=0))
    link = PartitionLink(0, "primary", tmp_path, settle_s=0.001)
    assert link.share(8) == 1.0 and link.ungranted == 1  # no answer to batch 8: whole GPU, not 1/132
    rec.write(ControlRecord(66, 66, 132, PolicyCode.ENCODE_BATCH_SPLIT, level=2, primary_batch=8))
    assert link.share(8) == 0.5  # the controller answered this batch: its split holds
    assert link.ungranted == 1
    link.close()
    rec.close()


def test_a_partner_waits_for_sms_while_its_encoder_holds_them_and_only_a_dead_controller_frees_it(
    tmp_path: Path,
) -> None:
    """The dynamic split grants local prefill 0 SMs while a micro-batch encodes: the partner's batch
    waits (the event loop stays free) until the split gives it SMs back, as the twin's does; only a
    wait past its bound (no micro-batch is that long) falls back to the whole GPU."""
    import asyncio

    from easerve_runtime.workers.partition_link import PartitionLink

    rec = ControlRecordFile(control_path(0, tmp_path), writer=True)
    rec.write(ControlRecord(132, 0, 132, PolicyCode.ENCODE_BATCH_SPLIT, level=0, primary_batch=8))
    link = PartitionLink(0, "partner", tmp_path)

    async def encoder_finishes() -> float:
        async def release() -> None:
            await asyncio.sleep(0.05)  # the micro-batch ends: the idle split gives the partner all
            rec.write(ControlRecord(0, 132, 132, PolicyCode.ENCODE_BATCH_SPLIT, level=0, primary_batch=0))

        ticks = 0

        async def loop_alive() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        alive = asyncio.create_task(loop_alive())
        t = asyncio.create_task(release())
        share = await link.granted(4, max_wait_s=5.0)
        await t
        alive.cancel()
        assert ticks >= 3, "the worker's event loop ran while the partner waited"
        return share

    assert asyncio.run(encoder_finishes()) == 1.0 and link.ungranted == 0  # granted, not a fallback
    assert link.last is not None and link.last.partner_sms == 132
    rec.write(ControlRecord(132, 0, 132, PolicyCode.ENCODE_BATCH_SPLIT, level=0, primary_batch=8))
    assert asyncio.run(link.granted(4, max_wait_s=0.02)) == 1.0 and link.ungranted == 1  # the bound: whole GPU
    link.close()
    rec.close()
