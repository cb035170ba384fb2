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
