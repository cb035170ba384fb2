"""Plain JSON trial records: the search's memory, persisted so a killed search can resume.

A search directory holds ``trials.jsonl``: one ``header`` line naming the search (method,
objective, rate, seeds, space, spec digest), an optional ``stage1`` line with the Stage-1 result,
then one ``trial`` line per trial, appended and fsync'ed as soon as the trial ends. WHY JSONL:
a kill can only ever lose the line being written, and a torn last line is detected (no newline)
and dropped on reopen, so a resume never repeats a finished trial and never invents one.

Optuna's own storage is kept in memory on purpose: these records are the only persistence, and
``stage2`` rebuilds its study from them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from easerve_operator.tuning.runners import TrialMetrics
from easerve_operator.tuning.space import Alloc, Candidate, round_s

RECORDS_FILE = "trials.jsonl"


@dataclass(frozen=True)
class TrialRecord:
    """One trial. ``cached`` trials re-proposed an already measured point: the search answered
    from memory, spent no device time, and does not count them against the budget (they are kept
    so that a resumed search replays exactly the same history)."""

    number: int
    method: str
    candidate: Candidate
    state: str  # "complete" | "failed"
    metrics: TrialMetrics | None = None
    value: float | None = None
    cached: bool = False
    seeded: bool = False
    error: str | None = None
    wall_s: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.state == "complete" and self.metrics is not None and self.value is not None

    @property
    def cost_s(self) -> float:
        """Device time this trial spent (0 for cached or failed-before-running trials)."""
        return 0.0 if self.cached or self.metrics is None else self.metrics.cost_s

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": "trial",
            "number": self.number,
            "method": self.method,
            **self.candidate.to_dict(),
            "state": self.state,
            "value": self.value,
            "cached": self.cached,
            "seeded": self.seeded,
            "wall_s": self.wall_s,
            "metrics": None if self.metrics is None else self.metrics.to_dict(),
        }
        if self.error is not None:
            d["error"] = self.error
        if self.extra:
            d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialRecord:
        cand = Candidate(Alloc.from_dict(d["alloc"]), int(d["batch_bound"]), round_s(d["offload_ratio"]))
        m = d.get("metrics")
        return cls(
            number=int(d["number"]),
            method=str(d["method"]),
            candidate=cand,
            state=str(d["state"]),
            metrics=None if m is None else TrialMetrics.from_dict(m),
            value=None if d.get("value") is None else float(d["value"]),
            cached=bool(d.get("cached", False)),
            seeded=bool(d.get("seeded", False)),
            error=d.get("error"),
            wall_s=float(d.get("wall_s", 0.0)),
            extra=dict(d.get("extra") or {}),
        )


def spec_digest(wire: Mapping[str, Any]) -> str:
    """Short stable digest of a spec's wire dict (identifies the search in the header)."""
    return hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()[:16]


class RecordMismatch(ValueError):
    """The records on disk belong to a different search than the one being resumed."""


class RecordStore:
    """Append-only JSONL records of one search (see module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / RECORDS_FILE

    def exists(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def _lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        complete, _, torn = raw.rpartition(b"\n")
        if torn:
            # a kill during a write left a partial line: drop it on disk too, so appends stay valid
            with self.path.open("r+b") as f:
                f.truncate(len(complete) + 1 if complete else 0)
        text = complete.decode() if complete else ""
        return [json.loads(ln) for ln in text.splitlines() if ln.strip()]

    def load(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[TrialRecord]]:
        """(header, stage1, trials) as found on disk; trials sorted by number, checked contiguous."""
        header: dict[str, Any] | None = None
        stage1: dict[str, Any] | None = None
        trials: list[TrialRecord] = []
        for d in self._lines():
            kind = d.get("kind")
            if kind == "header":
                header = d
            elif kind == "stage1":
                stage1 = d
            elif kind == "trial":
                trials.append(TrialRecord.from_dict(d))
        trials.sort(key=lambda r: r.number)
        for i, r in enumerate(trials):
            if r.number != i:
                raise RecordMismatch(
                    f"{self.path}: trial numbers are not contiguous at {i} (found {r.number})"
                )
        return header, stage1, trials

    def open(
        self, header: Mapping[str, Any], *, resume: bool
    ) -> tuple[dict[str, Any] | None, list[TrialRecord]]:
        """Start (or, with ``resume``, continue) a search; returns (stage1 dict, prior trials).

        Resuming checks that the header on disk names the same search; starting fresh refuses to
        overwrite existing records (pass ``resume`` or choose another directory).
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.exists():
            if not resume:
                raise FileExistsError(f"{self.path} already holds a search; resume it or use another --out")
            old, stage1, trials = self.load()
            want = {k: v for k, v in header.items() if k != "kind"}
            have = {k: v for k, v in (old or {}).items() if k != "kind"}
            if have != want:
                diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
                raise RecordMismatch(f"{self.path}: records belong to another search (differs in {diff})")
            return stage1, trials
        self._append({"kind": "header", **header})
        return None, []

    def write_stage1(self, stage1: Mapping[str, Any]) -> None:
        self._append({"kind": "stage1", **stage1})

    def append(self, record: TrialRecord) -> None:
        self._append(record.to_dict())

    def _append(self, d: Mapping[str, Any]) -> None:
        line = json.dumps(d, sort_keys=True) + "\n"
        with self.path.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
