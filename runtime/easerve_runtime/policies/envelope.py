"""Envelopes: one contiguous transfer per destination per encode micro-batch.

An encode micro-batch produces one embedding tensor per request, and after routing those go to
a handful of destinations (remote prefill workers, the local prefill worker). Each transfer has a
fixed setup cost (request-plane round trip, registration, a kernel launch for the copy), so
sending B small messages costs B setups where one suffices. The envelope packs every embedding
bound for the same destination into ONE contiguous buffer plus a small index of
``(request_id, offset, nbytes, shape, dtype)``; the receiver slices zero-copy views back out.

``SendWindow`` caps the sends in flight: when it is full the sender waits, which pushes back on
the encoder and bounds the memory held by unsent envelopes. It is pure counting; the asyncio
wrapper that awaits a free slot belongs to the workers.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

D = TypeVar("D", bound=Hashable)

ALIGN = 64
"""Each embedding starts on a 64-byte boundary, so views taken by ``unpack`` are aligned for any
dtype and for vectorised copies; the padding costs < 64 bytes per request."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """Where one request's embedding lives inside an envelope buffer."""

    request_id: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str

    def wire(self) -> dict[str, Any]:
        return {
            "requestId": self.request_id,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> IndexEntry:
        try:
            return cls(
                request_id=str(d["requestId"]),
                offset=int(d["offset"]),
                nbytes=int(d["nbytes"]),
                shape=tuple(int(x) for x in d["shape"]),
                dtype=str(d["dtype"]),
            )
        except KeyError as e:
            raise ValueError(f"envelope index entry: missing field {e.args[0]!r} in {dict(d)!r}") from None


@dataclass(frozen=True, slots=True)
class Envelope(Generic[D]):
    """All embeddings of one micro-batch bound for ``destination``, in one buffer."""

    destination: D
    buffer: bytes
    index: tuple[IndexEntry, ...]

    @property
    def nbytes(self) -> int:
        return len(self.buffer)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(e.request_id for e in self.index)

    def pack(self) -> tuple[bytes, list[dict[str, Any]]]:
        """The wire form: the raw buffer and a JSON-able index."""
        return self.buffer, [e.wire() for e in self.index]

    @staticmethod
    def unpack(
        buffer: bytes | bytearray | memoryview, index: Sequence[Mapping[str, Any] | IndexEntry]
    ) -> dict[str, npt.NDArray[Any]]:
        """request_id -> array (read-only zero-copy view into ``buffer``); validates the index."""
        out: dict[str, npt.NDArray[Any]] = {}
        size = len(buffer)
        for raw in index:
            e = raw if isinstance(raw, IndexEntry) else IndexEntry.from_wire(raw)
            try:
                dt = np.dtype(e.dtype)
            except TypeError:
                raise ValueError(f"envelope index {e.request_id}: unknown dtype {e.dtype!r}") from None
            count = 1
            for x in e.shape:
                if x < 0:
                    raise ValueError(f"envelope index {e.request_id}: negative shape {e.shape}")
                count *= x
            if count * dt.itemsize != e.nbytes:
                raise ValueError(
                    f"envelope index {e.request_id}: nbytes {e.nbytes} != shape {e.shape} x {dt} itemsize"
                )
            if e.offset < 0 or e.offset + e.nbytes > size:
                raise ValueError(
                    f"envelope index {e.request_id}: bytes [{e.offset}, {e.offset + e.nbytes}) "
                    f"outside the {size}-byte buffer"
                )
            if e.request_id in out:
                raise ValueError(f"envelope index: duplicate request id {e.request_id!r}")
            out[e.request_id] = np.frombuffer(buffer, dtype=dt, count=count, offset=e.offset).reshape(e.shape)
        return out

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return Envelope.unpack(self.buffer, self.index)


def build_envelopes(entries: Iterable[tuple[str, D, npt.ArrayLike]]) -> dict[D, Envelope[D]]:
    """Group ``(request_id, destination, embedding)`` by destination: one envelope each.

    Destinations and requests keep their first-seen order. A request id may appear only once in
    a micro-batch (a duplicate would silently overwrite on the receiver, so it is an error).
    """
    groups: dict[D, list[tuple[str, npt.NDArray[Any]]]] = {}
    seen: set[str] = set()
    for request_id, dest, emb in entries:
        if request_id in seen:
            raise ValueError(f"build_envelopes: request id {request_id!r} appears twice in one micro-batch")
        seen.add(request_id)
        arr = np.asarray(emb)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # (ascontiguousarray alone would turn 0-d into 1-d)
        if arr.dtype.hasobject:
            raise ValueError(
                f"build_envelopes: request {request_id!r} has an object array; need a numeric dtype"
            )
        groups.setdefault(dest, []).append((request_id, arr))
    out: dict[D, Envelope[D]] = {}
    for dest, items in groups.items():
        parts: list[bytes | memoryview] = []
        index: list[IndexEntry] = []
        offset = 0
        for request_id, arr in items:
            if offset:
                pad = _aligned(offset) - offset
                if pad:
                    parts.append(bytes(pad))
                    offset += pad
            nbytes = arr.nbytes
            if nbytes:
                parts.append(arr.reshape(-1).view(np.uint8).data)
            index.append(IndexEntry(request_id, offset, nbytes, tuple(arr.shape), arr.dtype.str))
            offset += nbytes
        out[dest] = Envelope(dest, b"".join(parts), tuple(index))
    return out


class SendWindow:
    """At most ``max_in_flight`` sends outstanding; ``try_acquire`` says whether one may start."""

    __slots__ = ("max_in_flight", "_in_flight", "peak")

    def __init__(self, max_in_flight: int) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self.peak = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def available(self) -> int:
        return self.max_in_flight - self._in_flight

    def try_acquire(self) -> bool:
        if self._in_flight >= self.max_in_flight:
            return False
        self._in_flight += 1
        if self._in_flight > self.peak:
            self.peak = self._in_flight
        return True

    def release(self) -> None:
        if self._in_flight <= 0:
            raise RuntimeError("SendWindow.release() without a matching acquire")
        self._in_flight -= 1
