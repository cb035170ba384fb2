"""Decode admission: which waiting sequences join the running batch at the next step boundary.

One object decides for the live decode worker (``workers/decode.py``) and the twin's decode
worker (``sim/stages.py``). A sequence joins when both hold (``spec.decode``):

- fewer than ``max_sequences`` are running (vLLM's ``max_num_seqs``), and
- its KV cache *at full length* (prompt + ``max_tokens``) fits next to what the running
  sequences have reserved at their full lengths, within the worker's KV capacity
  (``Profile.kv_budget_bytes(tp, spec.decode.kvMemoryFraction)``: memory × fraction minus
  weights and reserves).

Reserving at full length means a sequence admitted never has to be preempted for memory: the
worker waits instead of running out of memory. A lone sequence always runs (an empty worker
admits its head even if it alone exceeds the capacity; a prompt that long is rejected upstream),
so the queue cannot deadlock. Admission is FIFO: a large head blocks smaller ones behind it
rather than starving.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from easerve_runtime.api import DecodeSpec

T = TypeVar("T")


class DecodeAdmission(Generic[T]):
    """Waiting sequences, the running count and the KV bytes they reserve."""

    __slots__ = ("max_sequences", "kv_capacity_bytes", "_waiting", "running", "reserved")

    def __init__(self, max_sequences: int, kv_capacity_bytes: float) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.max_sequences = int(max_sequences)
        self.kv_capacity_bytes = float(kv_capacity_bytes)
        self._waiting: deque[tuple[T, float]] = deque()
        self.running = 0
        self.reserved = 0.0

    @classmethod
    def for_spec(cls, spec: DecodeSpec, kv_capacity_bytes: float) -> DecodeAdmission[T]:
        """``spec.decode``'s cap, with the KV capacity the worker's engine/profile reports."""
        return cls(spec.max_sequences, kv_capacity_bytes)

    def add(self, item: T, kv_need_bytes: float) -> None:
        """A sequence whose KV cache has arrived waits to join; ``kv_need_bytes`` at full length."""
        self._waiting.append((item, float(kv_need_bytes)))

    def fits(self, kv_need_bytes: float) -> bool:
        """Would a sequence needing ``kv_need_bytes`` join now?"""
        if self.running == 0:
            return True
        return self.running < self.max_sequences and self.reserved + kv_need_bytes <= self.kv_capacity_bytes

    def admit(self) -> list[tuple[T, float]]:
        """Pop the waiting sequences that join now (FIFO, stop at the first that does not fit).

        Returns ``(item, kv_need_bytes)``; pass the need back to :meth:`finish` when it leaves.
        """
        out: list[tuple[T, float]] = []
        w = self._waiting
        while w and self.fits(w[0][1]):
            item, need = w.popleft()
            self.running += 1
            self.reserved += need
            out.append((item, need))
        return out

    def finish(self, kv_need_bytes: float) -> None:
        """A running sequence left the batch: free its slot and its reservation."""
        if self.running <= 0:
            raise ValueError("finish: no sequence is running")
        self.running -= 1
        self.reserved -= kv_need_bytes
        if self.running == 0:
            self.reserved = 0.0  # no float drift across many add/subtract pairs

    @property
    def waiting(self) -> int:
        return len(self._waiting)
