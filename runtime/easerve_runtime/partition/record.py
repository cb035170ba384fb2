"""A fixed binary control record in ``/dev/shm``, one per GPU, guarded by a sequence number.

Why a seqlock and not a lock: the writer (the partition controller) must never block on a
reader, and readers (the encode worker before each micro-batch, the local prefill worker before
each step) must cost microseconds. The writer bumps ``seq`` to an odd value, writes the payload,
then bumps it to the next even value; a reader copies ``seq``, the payload, and ``seq`` again,
and retries unless both copies are equal and even. A reader therefore never returns a torn
record, and a crashed writer (odd ``seq`` forever) is detected by the retry limit.

Layout (little-endian, 64 bytes, ``seq`` 8-byte aligned so its store is a single word)::

    0  u32 magic 'EAPR'     4  u16 version   6  u16 reserved
    8  u64 seq
    16 u32 primary_sms      20 u32 partner_sms   24 u32 total_sms
    28 u8  policy           29 u8 downstream_active   30 u8 partner_active  31 u8 reserved
    32 i32 level            36 u32 primary_batch
    40 f64 bandwidth_ewma   48 f64 timestamp (CLOCK_MONOTONIC seconds, same host)
    56 u32 writer_pid       60 u32 reserved

A second, smaller *demand* record per tenant (``gpu0.primary``, ``gpu0.partner``) carries what a
worker wants (its next micro-batch, whether it is active) to the controller, again with one
writer each; so every file has exactly one writer.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")
MAGIC = 0x52504145  # b"EAPR" little-endian
VERSION = 1
_HEAD = struct.Struct("<IHHQ")  # magic, version, reserved, seq
_CONTROL = struct.Struct("<IIIBBBBiIddII")
_DEMAND = struct.Struct("<IBBHd")  # batch, active, reserved, reserved, timestamp
CONTROL_SIZE = _HEAD.size + _CONTROL.size
DEMAND_SIZE = _HEAD.size + _DEMAND.size
SEQ_OFFSET = 8
assert CONTROL_SIZE == 64, CONTROL_SIZE


class PolicyCode(IntEnum):
    NONE = 0
    STATIC = 1
    ENCODE_BATCH_SPLIT = 2
    BANDWIDTH_THROTTLE = 3


class TornReadError(RuntimeError):
    """The writer held the record mid-update for longer than the retry budget (crashed writer?)."""


@dataclass(frozen=True)
class ControlRecord:
    """The controller's decision for one GPU, as readers see it."""

    primary_sms: int
    partner_sms: int
    total_sms: int
    policy: PolicyCode
    level: int
    primary_batch: int = 0
    bandwidth_ewma: float = 0.0
    downstream_active: bool = False
    partner_active: bool = False
    timestamp: float = 0.0
    writer_pid: int = 0
    seq: int = 0


@dataclass(frozen=True)
class Demand:
    """What one tenant wants: its next micro-batch (0: idle) and whether it is active."""

    batch: int
    active: bool
    timestamp: float = 0.0
    seq: int = 0


def control_path(gpu: int, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / f"easerve-partition-gpu{gpu}"


def demand_path(gpu: int, role: str, shm_dir: Path = SHM_DIR) -> Path:
    if role not in ("primary", "partner"):
        raise ValueError(f"role: must be 'primary' or 'partner', got {role!r}")
    return shm_dir / f"easerve-partition-gpu{gpu}.{role}"


class _Seqlock:
    """One mmapped file with the header above and a fixed payload; one writer, many readers."""

    def __init__(self, path: Path, payload: struct.Struct, create: bool) -> None:
        self.path = Path(path)
        self.payload = payload
        self.size = _HEAD.size + payload.size
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                if os.fstat(fd).st_size != self.size:
                    os.ftruncate(fd, self.size)
                self._mm = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
            magic, version, _, seq = _HEAD.unpack_from(self._mm, 0)
            if magic != MAGIC or version != VERSION:
                _HEAD.pack_into(self._mm, 0, MAGIC, VERSION, 0, 0)
            elif seq % 2:  # a previous writer died mid-update: make the record readable again
                struct.pack_into("<Q", self._mm, SEQ_OFFSET, seq + 1)
        else:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size != self.size:
                    raise ValueError(f"{self.path}: size {os.fstat(fd).st_size}, expected {self.size}")
                self._mm = mmap.mmap(fd, self.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            magic, version, _, _ = _HEAD.unpack_from(self._mm, 0)
            if magic != MAGIC or version != VERSION:
                raise ValueError(f"{self.path}: not an EAServe partition record (magic/version)")
        # `seq` is loaded and stored as ONE aligned native 8-byte word. struct's "<Q" packs and
        # unpacks byte by byte, so a reader could see a half-updated seq across a carry (255 -> 256)
        # and accept a torn payload; a memoryview item access is a single machine load/store.
        # (Native order is little-endian on the x86-64 and arm64 hosts we run on.)
        self._seq = memoryview(self._mm).cast("Q")
        self._seq_index = SEQ_OFFSET // 8

    def write(self, *values: object) -> int:
        seqs, i = self._seq, self._seq_index
        seq = seqs[i]
        if seq % 2:
            seq += 1
        seqs[i] = seq + 1  # odd: update in progress
        self.payload.pack_into(self._mm, _HEAD.size, *values)
        seqs[i] = seq + 2  # even: consistent
        return int(seq + 2)

    def read(self, retries: int = 10_000) -> tuple[int, tuple[Any, ...]]:
        mm, seqs, k = self._mm, self._seq, self._seq_index
        for i in range(retries):
            s1 = seqs[k]
            if s1 % 2 == 0:
                values = self.payload.unpack_from(mm, _HEAD.size)
                s2 = seqs[k]
                if s1 == s2:
                    return int(s1), values
            if i > 100:
                time.sleep(0)
        raise TornReadError(f"{self.path}: no consistent read in {retries} tries (writer stuck mid-update?)")

    def close(self) -> None:
        self._seq.release()
        self._mm.close()


class ControlRecordFile:
    """Read or write one GPU's control record. ``writer=True`` creates it (the controller only)."""

    def __init__(self, path: Path, writer: bool = False) -> None:
        self._lock = _Seqlock(path, _CONTROL, create=writer)
        self.writer = writer
        self.path = self._lock.path

    def write(self, rec: ControlRecord) -> int:
        if not self.writer:
            raise PermissionError(f"{self.path}: opened read-only")
        if rec.primary_sms + rec.partner_sms > rec.total_sms:
            raise ValueError(
                f"primary_sms + partner_sms ({rec.primary_sms} + {rec.partner_sms}) exceeds total_sms ({rec.total_sms})"
            )
        return self._lock.write(
            rec.primary_sms,
            rec.partner_sms,
            rec.total_sms,
            int(rec.policy),
            int(rec.downstream_active),
            int(rec.partner_active),
            0,
            rec.level,
            rec.primary_batch,
            rec.bandwidth_ewma,
            rec.timestamp or time.monotonic(),
            rec.writer_pid or os.getpid(),
            0,
        )

    def read(self) -> ControlRecord:
        seq, v = self._lock.read()
        return ControlRecord(
            primary_sms=int(v[0]),
            partner_sms=int(v[1]),
            total_sms=int(v[2]),
            policy=PolicyCode(v[3]),
            downstream_active=bool(v[4]),
            partner_active=bool(v[5]),
            level=int(v[7]),
            primary_batch=int(v[8]),
            bandwidth_ewma=float(v[9]),
            timestamp=float(v[10]),
            writer_pid=int(v[11]),
            seq=seq,
        )

    def close(self) -> None:
        self._lock.close()


class DemandFile:
    """One tenant's demand record; the tenant writes it, the controller reads it."""

    def __init__(self, path: Path, writer: bool = False) -> None:
        self._lock = _Seqlock(path, _DEMAND, create=writer)
        self.writer = writer
        self.path = self._lock.path

    def write(self, batch: int, active: bool, timestamp: float | None = None) -> int:
        if batch < 0:
            raise ValueError(f"batch: must be >= 0, got {batch}")
        ts = time.monotonic() if timestamp is None else timestamp
        return self._lock.write(batch, int(active), 0, 0, ts)

    def read(self) -> Demand:
        seq, v = self._lock.read()
        return Demand(batch=int(v[0]), active=bool(v[1]), timestamp=float(v[4]), seq=seq)

    def close(self) -> None:
        self._lock.close()
