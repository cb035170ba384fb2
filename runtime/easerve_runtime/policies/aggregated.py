"""Aggregated (vLLM-style) iteration planning: who is admitted and which prefill chunks run.

One object plans every engine iteration of an aggregated engine, for the live aggregated worker
(``workers/aggregated.py``) and the twin's aggregated baseline (``sim/aggregated.py``) alike.
Each iteration:

- decodes one token for every running sequence (continuous batching); those decode tokens count
  against the iteration's token budget (vLLM's ``max_num_batched_tokens``, decode included);
- admits waiting requests FIFO while the sequence cap (running + still prefilling, vLLM's
  ``max_num_seqs``) and the KV memory (each reserved at full length, prompt + output) allow; a
  lone request always runs (an empty engine admits its head), so the queue cannot deadlock;
- fills what is left of the budget with prefill chunks, first come first served. A newly
  admitted request's media are encoded in the iteration of its first chunk (``Chunk.first``).

``chunked=True`` (vLLM's chunked prefill): a prompt longer than what is left of the budget is
split over iterations and nothing queues behind its unfinished chunk. ``chunked=False`` (an
engine that prefills whole prompts only): a prompt runs whole; it joins an iteration if it fits
in what is left of the budget, or alone (its iteration's only prefill) when it is longer than
the budget, like ``policies.prefill_batch``.

The driver tells the planner what happened: :meth:`prefilled` when a request's last chunk ran
(it starts decoding, or leaves if it wants no more tokens), :meth:`finish` when a running
sequence leaves, :meth:`drop` when a request is abandoned before it decodes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class _Entry(Generic[T]):
    __slots__ = ("item", "tokens", "need", "left")

    def __init__(self, item: T, tokens: int, need: float) -> None:
        self.item = item
        self.tokens = tokens
        self.need = need
        self.left = -1  # prompt tokens still to prefill; -1: not admitted yet


@dataclass(frozen=True)
class Chunk(Generic[T]):
    """Prompt tokens ``[start, start + tokens)`` of ``item`` prefilled this iteration."""

    item: T
    start: int
    tokens: int
    first: bool
    """Its first chunk: the request was admitted this iteration (encode its media now)."""
    last: bool
    """Its last chunk: the prompt is complete after this iteration (its first token is sampled)."""


@dataclass(frozen=True)
class Iteration(Generic[T]):
    """One engine iteration: ``decodes`` running sequences step once, ``chunks`` are prefilled."""

    chunks: list[Chunk[T]]
    tokens: int
    """Prefill tokens planned (decode tokens not included)."""
    decodes: int

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decodes


class AggregatedPlanner(Generic[T]):
    """Waiting requests, the sequences in flight and the KV bytes they reserve; ``plan()`` cuts an iteration."""

    __slots__ = (
        "token_budget",
        "max_sequences",
        "kv_capacity_bytes",
        "chunked",
        "_waiting",
        "running",
        "prefilling",
        "reserved",
    )

    def __init__(
        self, token_budget: int, max_sequences: int, kv_capacity_bytes: float, *, chunked: bool = True
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.token_budget = int(token_budget)
        self.max_sequences = int(max_sequences)
        self.kv_capacity_bytes = float(kv_capacity_bytes)
        self.chunked = chunked
        self._waiting: deque[_Entry[T]] = deque()
        self.running = 0
        """Sequences decoding (one token each per iteration)."""
        self.prefilling = 0
        """Admitted, prompt not fully prefilled yet."""
        self.reserved = 0.0
        """KV bytes reserved by admitted requests, each at full length."""

    def add(self, item: T, tokens: int, kv_need_bytes: float) -> None:
        """A request arrives: ``tokens`` prompt tokens (text + media), its KV cache at full length."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._waiting.append(_Entry(item, int(tokens), kv_need_bytes))

    def plan(self) -> Iteration[T]:
        """The next iteration: admit FIFO, then chunks within ``token_budget - running``."""
        w = self._waiting
        chunks: list[Chunk[T]] = []
        tokens = 0
        n = self.running
        budget = max(1, self.token_budget - n)
        while w and tokens < budget:
            e = w[0]
            first = e.left < 0
            if first:  # not admitted yet: sequence cap and KV memory
                alone = n == 0 and not chunks
                if not alone and (
                    n + self.prefilling >= self.max_sequences
                    or self.reserved + e.need > self.kv_capacity_bytes
                ):
                    break
                if not self.chunked and chunks and e.tokens > budget - tokens:
                    break  # a whole prompt that does not fit waits for the next iteration
                self.reserved += e.need
                self.prefilling += 1
                e.left = e.tokens
            take = min(e.left, budget - tokens) if self.chunked else e.left
            start = e.tokens - e.left
            tokens += take
            e.left -= take
            last = e.left == 0
            if last:
                w.popleft()
            chunks.append(Chunk(e.item, start, take, first, last))
            if not last:
                break
        return Iteration(chunks, tokens, n)

    def prefilled(self, kv_need_bytes: float, decodes: bool) -> None:
        """A request's last chunk ran: it joins the running sequences (``decodes``) or leaves."""
        self.prefilling -= 1
        if decodes:
            self.running += 1
        else:
            self.reserved -= kv_need_bytes

    def finish(self, kv_need_bytes: float) -> None:
        """A running sequence left: free its place and its reservation."""
        if self.running <= 0:
            raise ValueError("finish: no sequence is running")
        self.running -= 1
        self.reserved -= kv_need_bytes

    def drop(self, item: T) -> bool:
        """Abandon ``item`` before it decodes (its client went away, or it failed). Returns True
        when it was found waiting or prefilling (its reservation is freed); False otherwise."""
        for e in self._waiting:
            if e.item is item:
                self._waiting.remove(e)
                if e.left >= 0:
                    self.prefilling -= 1
                    self.reserved -= e.need
                return True
        return False

    def resize(self, item: T, tokens: int) -> None:
        """The prompt of an admitted, partly planned request turned out ``tokens`` long (a real
        engine knows it only once encode applied the processor): what is left follows."""
        for e in self._waiting:
            if e.item is item:
                done = e.tokens - max(e.left, 0)
                e.tokens = max(int(tokens), done)
                if e.left >= 0:
                    e.left = e.tokens - done
                return

    def queued(self) -> list[T]:
        """Requests waiting or partly prefilled, in order."""
        return [e.item for e in self._waiting]

    @property
    def waiting(self) -> int:
        """Requests not admitted yet."""
        return sum(1 for e in self._waiting if e.left < 0)

    def __len__(self) -> int:
        return len(self._waiting)
