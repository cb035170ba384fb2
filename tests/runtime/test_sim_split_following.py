"""The sim engine's local prefill follows the SM split while a batch runs, as the twin's does.

Why: the twin re-times a local prefill batch at every split change (``sim/stages.py``,
``PrefillWorker.set_share``); the live sim engine timed it once at the share it started with, so on
the local cluster the all-local trial (6E-0P, s = 0) answered 10-15 % faster than the twin at the
mean. These tests pin the live rule to the twin's arithmetic on a virtual clock, and the links'
side (reading the split, being woken by the controller's poke) on real sockets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from easerve_runtime.engines.base import PrefillInput, SplitFollowingPrefillEngine
from easerve_runtime.engines.sim import SimEngine
from easerve_runtime.partition.record import ControlRecord, ControlRecordFile, PolicyCode, control_path
from easerve_runtime.partition.wake import WakeSender, tenant_wake_path
from easerve_runtime.workers.partition_link import PartitionGroupLink, PartitionLink


class InverseShareProfile:
    """A prefill batch takes ``1 / share`` seconds: the arithmetic of re-timing is then plain."""

    anyres = False

    def prefill_s(self, tokens: int, sm_share: float = 1.0, **kw: Any) -> float:
        return 1.0 / sm_share

    def kv_bytes(self, tokens: int) -> int:
        return tokens


class ScheduledSplit:
    """A split that changes at given virtual times; waiting advances the virtual clock.

    ``late_s``: each wait that times out returns that much late (a busy host's sleep)."""

    def __init__(self, share: float | None, changes: list[tuple[float, float | None]], late_s: float = 0.0) -> None:
        self.t = 0.0
        self.share = share
        self.changes = sorted(changes, key=lambda c: c[0])
        self.late_s = late_s
        self.woken = 0

    def clock(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += seconds

    def current(self) -> float | None:
        return self.share

    async def wait_change(self, timeout: float) -> bool:
        if self.changes and self.changes[0][0] <= self.t + timeout:
            self.t, self.share = self.changes.pop(0)
            self.woken += 1
            return True
        self.t += timeout + self.late_s
        return False


def run(split: ScheduledSplit, share: float = 1.0, debt: float = 0.0, max_pause_s: float = 2.0) -> SimEngine:
    eng = SimEngine(InverseShareProfile(), speedup=1.0, bytes_scale=1.0, clock=split.clock, sleep=split.sleep)
    eng._debt["prefill"] = debt
    batch = [PrefillInput("r0", 100, 0, 1)]
    out = asyncio.run(eng.prefill_following(batch, share, split, max_pause_s))
    assert [o.request_id for o in out] == ["r0"]
    return eng


def test_the_sim_engine_is_an_engine_that_follows_the_split() -> None:
    assert isinstance(SimEngine(InverseShareProfile()), SplitFollowingPrefillEngine)


def test_a_split_that_never_changes_costs_the_profiles_time() -> None:
    split = ScheduledSplit(0.5, [])
    run(split, share=0.5)
    assert split.t == pytest.approx(2.0)


def test_the_work_left_is_re_timed_at_each_new_split_as_the_twin_does() -> None:
    """Share 1 → 0.5 at 0.4 s: 0.6 of the work is left and runs at 2 s for the whole, so 1.2 s more."""
    split = ScheduledSplit(1.0, [(0.4, 0.5)])
    run(split)
    assert split.t == pytest.approx(0.4 + 0.6 * 2.0)
    split = ScheduledSplit(0.5, [(0.5, 1.0)])  # and back: a quarter done, three quarters at 1 s
    run(split, share=0.5)
    assert split.t == pytest.approx(0.5 + 0.75 * 1.0)


def test_a_zero_share_pauses_the_batch_until_the_split_gives_sms_back() -> None:
    """The dynamic split grants local prefill 0 SMs while a micro-batch encodes."""
    split = ScheduledSplit(1.0, [(0.2, 0.0), (0.5, 1.0)])
    run(split)
    assert split.t == pytest.approx(1.0 + 0.3)
    assert split.woken == 2


def test_a_pause_past_its_bound_finishes_on_the_whole_gpu() -> None:
    """A controller that died leaving the encoder's split must not stall the batch for ever."""
    split = ScheduledSplit(1.0, [(0.2, 0.0)])
    run(split, max_pause_s=2.0)
    assert split.t == pytest.approx(0.2 + 2.0 + 0.8)


def test_no_published_split_means_the_whole_gpu() -> None:
    split = ScheduledSplit(0.5, [(1.0, None)])  # the record went away half-way
    run(split, share=0.5)
    assert split.t == pytest.approx(1.0 + 0.5 * 1.0)


def test_the_stages_overrun_is_paid_back_and_the_last_lateness_kept() -> None:
    """As ``SimEngine._wait``: an earlier overrun shortens this batch, this one's lateness is kept."""
    split = ScheduledSplit(1.0, [], late_s=0.01)
    eng = run(split, debt=0.03)
    assert split.t == pytest.approx(1.0 - 0.03 + 0.01)
    assert eng._debt["prefill"] == pytest.approx(0.01)


def _publish(rec: ControlRecordFile, partner_sms: int, total: int = 132) -> None:
    rec.write(ControlRecord(total - partner_sms, partner_sms, total, PolicyCode.ENCODE_BATCH_SPLIT, level=0))


def test_a_partner_reads_the_split_and_is_woken_by_the_controllers_poke(tmp_path: Path) -> None:
    link = PartitionLink(0, "partner", tmp_path)
    assert link.current() is None  # no controller has published: the whole GPU
    rec = ControlRecordFile(control_path(0, tmp_path), writer=True)
    _publish(rec, 0)
    assert link.current() == 0.0  # the encoder holds every SM: paused, not "whole GPU"
    _publish(rec, 66)
    assert link.current() == 0.5

    async def waits() -> tuple[bool, bool]:
        quiet = await link.wait_change(0.01)
        WakeSender(tenant_wake_path(control_path(0, tmp_path), "partner")).poke()
        return quiet, await link.wait_change(30.0)

    assert asyncio.run(waits()) == (False, True)
    link.close()
    rec.close()


def test_a_tp2_partner_follows_its_slowest_gpu_and_wakes_on_either(tmp_path: Path) -> None:
    link = PartitionGroupLink([0, 1], "partner", tmp_path)
    assert link.current() is None
    rec1 = ControlRecordFile(control_path(1, tmp_path), writer=True)
    _publish(rec1, 33)
    assert link.current() == 0.25  # GPU 0 has no split yet: its whole GPU is not the smaller
    rec0 = ControlRecordFile(control_path(0, tmp_path), writer=True)
    _publish(rec0, 0)
    assert link.current() == 0.0

    async def woken_by_gpu1() -> tuple[bool, bool]:
        quiet = await link.wait_change(0.01)
        WakeSender(tenant_wake_path(control_path(1, tmp_path), "partner")).poke()
        return quiet, await link.wait_change(30.0)

    assert asyncio.run(woken_by_gpu1()) == (False, True)
    link.close()
    rec0.close()
    rec1.close()
