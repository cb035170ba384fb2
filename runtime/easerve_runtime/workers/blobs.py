"""Large payloads between the stages of ONE host through shared memory: the request plane carries
only a name.

Why: the request plane carries JSON-like objects, so bytes travel base64-encoded, and on a real
model they are large: a 2,900-token LLaVA-NeXT 7B request's KV cache is ~390 MB and its image
embedding rows ~24 MB per image. Encoding, framing and decoding those on the workers' event loops
measured ~0.1 GB/s on the H200 host (a 4 s handoff per request, with the decode loop blocked
meanwhile). When sender and receiver share a host, a file in a shared-memory directory moves the
same bytes at memory speed, written and read off the event loop.

Enabled by ``$EASERVE_BLOB_DIR`` (``easerve serve`` sets it to a private directory under
``/dev/shm``, or under its workdir when ``/dev/shm`` is small: every process it starts is on its
host). Unset (pods on different nodes), stages
use the request plane as before. The receiver takes a blob (reads and deletes it); the sender
discards it when its stream ends, so a receiver that died before reading leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import uuid
from pathlib import Path

BLOB_DIR_ENV = "EASERVE_BLOB_DIR"
_NAME = re.compile(r"^[0-9a-f]{32}\.blob$")


class HostBlobs:
    """Put bytes under a fresh name, take them back once (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls) -> HostBlobs | None:
        d = os.environ.get(BLOB_DIR_ENV)
        return cls(d) if d else None

    def _path(self, name: str) -> Path:
        if not _NAME.match(name):  # a name from the wire never leaves this directory
            raise ValueError(f"bad blob name {name!r}")
        return self.dir / name

    def put_sync(self, data: bytes | memoryview) -> str:
        name = f"{uuid.uuid4().hex}.blob"
        tmp = self.dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        tmp.replace(self.dir / name)  # a reader never sees a partial blob
        return name

    def take_sync(self, name: str, mapped: bool = False) -> bytearray | mmap.mmap:
        """The blob's bytes, writable (tensors are built on them without another copy); the file is gone.

        ``mapped``: a private copy-on-write mapping of the file instead of a read into fresh memory:
        no copy at all (the pages stay until the mapping is dropped). Why: reading a ~390 MB KV
        cache into a new buffer cost ~0.4 s of page faults and copying on a small host, on the way
        from a request's first token to its second."""
        path = self._path(name)
        if mapped:
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size:
                        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            except FileNotFoundError:
                raise ValueError(f"blob {name} is gone (taken twice, or its sender discarded it)") from None
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()  # the mapping keeps the pages; the name is freed now
            return bytearray()
        try:
            size = path.stat().st_size
            buf = bytearray(size)  # writable: tensors are built on it without another copy
            with open(path, "rb") as f:
                got = f.readinto(buf)
        except FileNotFoundError:
            raise ValueError(f"blob {name} is gone (taken twice, or its sender discarded it)") from None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        if got != size:
            raise ValueError(f"blob {name}: read {got} of {size} bytes")
        return buf

    def discard(self, name: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._path(name).unlink()

    async def put(self, data: bytes | memoryview) -> str:
        return await asyncio.to_thread(self.put_sync, data)

    async def take(self, name: str, mapped: bool = False) -> bytearray | mmap.mmap:
        return await asyncio.to_thread(self.take_sync, name, mapped)
