"""Per-request response queues: how a batch loop talks back to the handler awaiting a request.

Dynamo calls a handler per request and streams whatever it yields; the batch loops (encode,
prefill, decode) work on many requests at once. Each handler registers a queue under its
request id, yields from it, and the loop puts items into it. ``None`` ends a stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any


class Streams:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[Any]] = {}

    def open(self, key: str) -> asyncio.Queue[Any]:
        if key in self._queues:
            raise ValueError(f"request id {key!r} is already in flight")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = q
        return q

    def put(self, key: str, item: Any) -> bool:
        """Deliver ``item``; False if nobody waits any more (the client went away)."""
        q = self._queues.get(key)
        if q is None:
            return False
        q.put_nowait(item)
        return True

    def close(self, key: str) -> None:
        self.put(key, None)

    def discard(self, key: str) -> None:
        self._queues.pop(key, None)

    def __len__(self) -> int:
        return len(self._queues)

    def __contains__(self, key: object) -> bool:
        """Whether someone still waits on ``key`` (False once its handler went away: a client disconnect)."""
        return key in self._queues

    async def drain(self, key: str) -> AsyncIterator[Any]:
        """Yield the items of ``key`` until ``None``; unregisters on exit."""
        q = self._queues[key]
        try:
            while True:
                item = await q.get()
                if item is None:
                    return
                yield item
        finally:
            self.discard(key)
