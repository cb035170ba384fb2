"""The partition controller: reads tenants' demand and the NVML signal, writes the control record.

It is the only writer of its GPU's control record. Each tick it reads the primary tenant's
demand record (the encode worker's next micro-batch, or the shared stage's step) and the
partner's (local prefill / downstream activity), asks the pure policy for a split, and publishes
it. NVML is sampled on its own slower cadence (``sample_period_s``) so a ~1 ms GPM read never
sits in a tick that reacts to a micro-batch.

:class:`ControllerCore` is the decision step with ``now`` passed in (tested on the CPU);
:func:`run_loop` is the thin I/O shell around it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from easerve_runtime.partition.record import (
    ControlRecord,
    ControlRecordFile,
    Demand,
    DemandFile,
    PolicyCode,
)
from easerve_runtime.policies.partition import BandwidthThrottle, EncodeBatchSplit, Ewma

log = logging.getLogger(__name__)


@dataclass
class ControllerCore:
    """One decision per tick for one GPU. Exactly one of ``split`` / ``throttle`` / ``static_sms``."""

    total_sms: int
    split: EncodeBatchSplit | None = None
    throttle: BandwidthThrottle | None = None
    static_sms: int | None = None

    def __post_init__(self) -> None:
        chosen = [x is not None for x in (self.split, self.throttle, self.static_sms)]
        if sum(chosen) > 1:
            raise ValueError("policy: give one of split, throttle or static_sms")
        self.policy = (
            PolicyCode.ENCODE_BATCH_SPLIT
            if self.split
            else PolicyCode.BANDWIDTH_THROTTLE
            if self.throttle
            else PolicyCode.STATIC
            if self.static_sms is not None
            else PolicyCode.NONE
        )
        self.ewma = self.throttle.ewma if self.throttle else Ewma()

    def observe(self, memory_percent: float) -> None:
        self.ewma.update(memory_percent)

    def decide(self, primary: Demand, partner: Demand, now: float) -> ControlRecord:
        downstream = partner.active
        if self.split is not None:
            s = self.split.decide(primary.batch) if primary.batch > 0 else self.split.idle()
            prim, part, level = s.primary_sms, s.partner_sms, s.level
        elif self.throttle is not None:
            s = self.throttle.decide(downstream, now)
            prim, part, level = s.primary_sms, s.partner_sms, s.level
        elif self.static_sms is not None:
            prim, part, level = self.static_sms, self.total_sms - self.static_sms, 0
        else:  # no partition: both tenants run unconfined; the record only reports the signal
            prim, part, level = self.total_sms, 0, -1
        return ControlRecord(
            primary_sms=prim,
            partner_sms=part,
            total_sms=self.total_sms,
            policy=self.policy,
            level=level,
            primary_batch=primary.batch,
            bandwidth_ewma=self.ewma.value or 0.0,
            downstream_active=downstream,
            partner_active=partner.active,
            timestamp=now,
            writer_pid=os.getpid(),
        )


def run_loop(
    core: ControllerCore,
    control: ControlRecordFile,
    primary: DemandFile | None,
    partner: DemandFile | None,
    sample: Callable[[], float] | None,
    tick_s: float = 0.0005,
    sample_period_s: float = 0.02,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    wake: Callable[[float], bool] | None = None,
    idle_wait_s: float = 0.1,
    published: Callable[[], None] | None = None,
) -> int:
    """Decide until ``stop()``; write only when the decision or signal changes. Returns ticks run.

    Without ``wake`` it polls the demand records every ``tick_s``. With ``wake`` (``wake.py``: the
    tenants poke after each demand write) it sleeps until poked, so an idle GPU costs no CPU and a
    demand is answered as soon as it is written: ``wake(timeout)`` is called with ``idle_wait_s``,
    shortened to the next NVML sample, and with ``tick_s`` while a tenant runs under a policy that
    changes with time rather than demand (the bandwidth throttle follows its signal).
    ``published`` is called after each record that carries a new split (``wake.py``: it pokes the
    tenants, which sleep until then rather than re-reading the record)."""
    idle = Demand(batch=0, active=False)
    last: tuple[int, int, int, bool] | None = None
    next_sample = clock()
    ticks = 0
    while not stop():
        now = clock()
        if sample is not None and now >= next_sample:
            try:
                core.observe(sample())
            except Exception as exc:  # a flaky NVML read must not stop partitioning
                log.warning("NVML sample failed: %s", exc)
            next_sample = now + sample_period_s
        p = primary.read() if primary else idle
        q = partner.read() if partner else idle
        rec = core.decide(p, q, now)
        key = (rec.primary_sms, rec.partner_sms, rec.primary_batch, rec.downstream_active)
        if key != last or ticks % 200 == 0:
            control.write(rec)
            if key != last and published is not None:
                published()
            last = key
        ticks += 1
        if wake is None:
            time.sleep(tick_s)
            continue
        timeout = tick_s if core.throttle is not None and (p.active or q.active) else idle_wait_s
        if sample is not None:
            timeout = min(timeout, max(0.0, next_sample - clock()))
        wake(timeout)
    return ticks
