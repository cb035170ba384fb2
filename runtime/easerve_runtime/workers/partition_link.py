"""A worker's side of SM partitioning: publish demand, read the share the controller granted.

When an encode GPU also hosts a local prefill worker and ``spec.smPartition.mode`` is static or
dynamic, the pod runs ``easerve partition-controller`` (the only writer of the GPU's control
record, ``partition/record.py``). Before each engine call the encode worker (role ``primary``)
and the local prefill worker (role ``partner``) write their demand (next batch, active) and read
the current split; after the call they mark themselves idle. Reads are seqlock copies from
``/dev/shm`` (microseconds), so this sits on the hot path.

Until the controller has published a record (or when none runs, e.g. ``easerve serve`` without
a GPU) the share is 1.0: the worker behaves as if it owned the GPU.

Each demand write is followed by a wake-up datagram to the controller (``partition/wake.py``),
which sleeps until one comes and answers at once (a controller that cannot bind its socket polls
every 0.5 ms instead), and the controller pokes each tenant back after it publishes a new split,
so a tenant waiting for its answer sleeps instead of re-reading the record every 0.5 ms. An
encoder that announces a batch waits, briefly and bounded (``SETTLE_S``), for a record that
answers its batch (the record echoes ``primary_batch``). An encoder still granted no SMs after
that (the controller lags, hangs or died and left its idle split, where encode gets 0 SMs) runs on
the whole GPU rather than on one SM: contention is slower than isolation, but starving the encoder
stops serving.

The partner (local prefill) is different: the dynamic split grants it 0 SMs *on purpose* while a
micro-batch encodes, so a partner batch waits for SMs (``granted``, async: the worker keeps
receiving envelopes) until the encoder's batch ends, as the twin's local prefill worker does
(``sim/stages.py``: a zero share pauses it). Only a wait longer than ``PARTNER_WAIT_S`` (no
micro-batch is that long: the controller is gone) falls back to the whole GPU. Before this, a
partner granted 0 SMs ran at once on the whole GPU, and on the local cluster (sim engine, nothing
contends) the candidates with the most local prefill answered faster than the twin predicted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from easerve_runtime.partition.record import (
    SHM_DIR,
    ControlRecord,
    ControlRecordFile,
    DemandFile,
    control_path,
    demand_path,
)
from easerve_runtime.partition.wake import WakeListener, WakeSender, tenant_wake_path, wake_path

log = logging.getLogger("easerve.partition")

SETTLE_S = 0.003
"""Longest an encoder waits for the controller to answer its batch (six polling ticks)."""
PARTNER_WAIT_S = 2.0
"""Longest a partner waits for SMs while its encoder runs a micro-batch before it takes the whole GPU."""
PARTNER_POLL_S = 0.0005
"""How often a tenant re-reads the record while it waits, when it could not bind its wake-up socket."""
TENANTS_POLL_ENV = "EASERVE_PARTITION_TENANTS_POLL"
"""Set to 1: the tenants re-read the record every ``PARTNER_POLL_S`` while they wait, as before
the controller woke them (``benchmarks/partition_wakeups.py`` compares the two in one run)."""
PARTNER_RECHECK_S = 0.02
"""How often a tenant woken by the controller re-reads the record anyway while it waits (a safety
net: the controller pokes after each new split, so this bounds only a poke that never comes)."""


class PartitionLink:
    def __init__(self, gpu: int, role: str, shm_dir: Path = SHM_DIR, settle_s: float = SETTLE_S) -> None:
        if role not in ("primary", "partner"):
            raise ValueError(f"role: must be 'primary' or 'partner', got {role!r}")
        self.role = role
        self.demand = DemandFile(demand_path(gpu, role, shm_dir), writer=True)
        self.control_path = control_path(gpu, shm_dir)
        self._wake = WakeSender(wake_path(self.control_path))
        self._woken = None if os.environ.get(TENANTS_POLL_ENV) == "1" else WakeListener.bind(
            tenant_wake_path(self.control_path, role),
            fallback=f"the {role} re-reads the record every {PARTNER_POLL_S * 1e3:g} ms")
        """The controller pokes this after each new split; None (this host cannot bind it): poll."""
        self._control: ControlRecordFile | None = None
        self.last: ControlRecord | None = None
        self.settle_s = settle_s
        self.ungranted = 0  # calls that found no SMs granted and fell back to the whole GPU

    def _announce(self, batch: int, active: bool) -> None:
        """Write the demand, then wake the controller so it answers now rather than at a poll."""
        self.demand.write(max(0, batch), active)
        self._wake.poke()

    def _read(self) -> ControlRecord | None:
        if self._control is None:
            if not self.control_path.exists():
                return None
            try:
                self._control = ControlRecordFile(self.control_path)
            except (OSError, ValueError) as exc:
                log.warning("partition record unreadable (%s); using the whole GPU", exc)
                return None
        try:
            return self._control.read()
        except Exception as exc:  # a stuck writer must not stop serving
            log.warning("partition record read failed (%s); using the whole GPU", exc)
            return None

    def share(self, batch: int) -> float:
        """Announce a batch of ``batch`` and return this tenant's SM fraction in (0, 1]."""
        self._announce(batch, True)
        rec = self._read()
        if self.role == "primary" and batch > 0 and rec is not None and rec.seq:
            deadline = time.monotonic() + self.settle_s
            while rec is not None and rec.primary_batch != batch and (left := deadline - time.monotonic()) > 0:
                if self._woken is not None:
                    self._woken.wait(left)  # the controller pokes once it has answered
                else:
                    time.sleep(0.0001)
                rec = self._read()
        self.last = rec
        if rec is None or rec.total_sms <= 0 or rec.seq == 0:
            return 1.0
        sms = rec.primary_sms if self.role == "primary" else rec.partner_sms
        if sms <= 0:  # nothing granted to a tenant with work: never run it on a single SM
            if self.ungranted == 0:
                log.warning(
                    "partition controller granted %s no SMs for a batch of %d (%s): using the whole GPU",
                    self.role, batch, self.control_path,
                )
            self.ungranted += 1
            return 1.0
        return min(1.0, sms / rec.total_sms)

    async def granted(self, batch: int, max_wait_s: float = PARTNER_WAIT_S) -> float:
        """The partner's share for a batch: waits (without blocking the event loop) while the split
        grants it no SMs, at most ``max_wait_s``; then ``share``'s whole-GPU fallback."""
        self._announce(batch, True)
        deadline = time.monotonic() + max_wait_s
        while True:
            rec = self._read()
            if rec is None or rec.total_sms <= 0 or rec.seq == 0 or rec.partner_sms > 0:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._woken is not None:
                await self._woken.wait_async(min(left, PARTNER_RECHECK_S))
            else:
                await asyncio.sleep(PARTNER_POLL_S)
        return self.share(batch)

    def idle(self) -> None:
        self._announce(0, False)

    def close(self) -> None:
        self.demand.close()
        self._wake.close()
        if self._woken is not None:
            self._woken.close()
        if self._control is not None:
            self._control.close()


class PartitionGroupLink:
    """A local prefill worker of TP k spans k encode GPUs (``easerve_runtime.topology``): it
    announces its demand on every GPU's record and runs at the smallest share it was granted,
    since a TP step advances at the pace of its slowest rank (the twin's rule too)."""

    def __init__(self, gpus: list[int], role: str, shm_dir: Path = SHM_DIR) -> None:
        if not gpus:
            raise ValueError("gpus: a partition group needs at least one GPU")
        self.links = [PartitionLink(g, role, shm_dir) for g in gpus]

    @property
    def last(self) -> ControlRecord | None:
        return self.links[0].last

    def share(self, batch: int) -> float:
        return min(link.share(batch) for link in self.links)

    async def granted(self, batch: int, max_wait_s: float = PARTNER_WAIT_S) -> float:
        deadline = time.monotonic() + max_wait_s
        shares = [await link.granted(batch, max(0.0, deadline - time.monotonic())) for link in self.links]
        return min(shares)

    def idle(self) -> None:
        for link in self.links:
            link.idle()

    def close(self) -> None:
        for link in self.links:
            link.close()
