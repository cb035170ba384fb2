"""Prefill batching: which waiting requests go into the next prefill batch (``spec.prefill``).

One object decides for the live prefill worker (``workers/prefill.py``, remote and local) and for
the twin's prefill workers (``sim/stages.py``), so both batch the same way. The rule is vLLM's
``max_num_batched_tokens`` for whole prompts: take requests first come first served while the
batch stays within the token budget; a request longer than the budget still runs, alone (it
would otherwise wait forever). No chunking: the disaggregated prefill runs whole prompts.

Why one budget matters: under load a larger budget makes larger, longer batches, so a request
that arrives during one waits longer for its first token. The live worker used 16384 and the
twin 8192; at 86 % prefill utilisation that alone put the twin's P99 TTFT 19 % below the live
runtime's (docs/twin.md, "Agreement near saturation").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Generic, TypeVar

from easerve_runtime.api import PrefillSpec

T = TypeVar("T")


class PrefillBatcher(Generic[T]):
    """A FIFO queue of requests with their prompt tokens; ``take()`` cuts the next batch."""

    __slots__ = ("max_batch_tokens", "_queue", "_tokens")

    def __init__(self, max_batch_tokens: int) -> None:
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.max_batch_tokens = int(max_batch_tokens)
        self._queue: deque[tuple[T, int]] = deque()
        self._tokens = 0

    @classmethod
    def for_spec(cls, spec: PrefillSpec) -> PrefillBatcher[T]:
        """The batcher ``spec.prefill`` describes."""
        return cls(spec.max_batch_tokens)

    def add(self, item: T, tokens: int) -> None:
        """Queue one request whose prompt (text + multimodal rows) has ``tokens`` tokens."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._queue.append((item, int(tokens)))
        self._tokens += int(tokens)

    def extend(self, items: Iterable[tuple[T, int]]) -> None:
        for item, tokens in items:
            self.add(item, tokens)

    def take(self) -> tuple[list[T], int]:
        """The next batch and its token total: the head request, then more while they fit.

        Empty queue: ``([], 0)``.
        """
        q = self._queue
        if not q:
            return [], 0
        item, tokens = q.popleft()
        batch = [item]
        budget = self.max_batch_tokens
        while q and tokens + q[0][1] <= budget:
            nxt, t = q.popleft()
            batch.append(nxt)
            tokens += t
        self._tokens -= tokens
        return batch, tokens

    @property
    def pending(self) -> int:
        """Requests waiting."""
        return len(self._queue)

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens waiting."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)
