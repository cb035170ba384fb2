"""Wake-ups from the tenants to the partition controller: a datagram socket beside the records.

Why: the controller used to poll the tenants' demand records every tick (0.5 ms). That is 2,000
wake-ups a second per encode GPU whether or not anything happens: 8.5 % of a core per idle
controller on the 2-core CI host, and on the local cluster a 6-encode-pod trial ran six of them
beside its workers. Polling also reacts late exactly when it matters, since a loaded host delays
every tick. Now a tenant, after writing its demand record, sends a one-byte datagram to
``easerve-partition-gpuN.wake`` in the same directory as the records (an ``emptyDir`` the pod's
containers share, like the records); the controller blocks on that socket and answers the demand
at once. The records stay the source of truth: a datagram carries nothing, several collapse into
one wake-up, and a lost one (queue full) only means the controller is awake already.

The other direction is the same mechanism: each tenant binds ``easerve-partition-gpuN.<role>.wake``
and the controller pokes both tenants after each record it publishes with a new split. The local
prefill (partner) waits for SMs while its encoder runs a micro-batch, and the encoder waits, up to
``SETTLE_S``, for the record that answers its batch; both used to re-read the record every 0.5 ms
(``workers/partition_link.py``) and now sleep until the controller's poke, re-reading at most every
``PARTNER_RECHECK_S`` in case none comes.

Either side degrades to the old behaviour rather than failing: a controller that cannot bind the
socket (a path longer than ``sun_path``, an unsupported filesystem) polls at its tick, and a
tenant whose datagram finds no listener (no controller, or one that died) carries on: the
record's share rules (``workers.partition_link``) already cover a missing controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def wake_path(control: Path) -> Path:
    """The controller's socket beside a GPU's control record (``record.control_path``)."""
    return control.with_name(control.name + ".wake")


def tenant_wake_path(control: Path, role: str) -> Path:
    """Tenant ``role``'s (``primary`` or ``partner``) socket beside a GPU's control record: the
    controller pokes it after publishing a new split."""
    return control.with_name(f"{control.name}.{role}.wake")


class WakeListener:
    """The controller's end: ``wait(timeout)`` returns True when a tenant poked, False on timeout."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.sock = sock
        self.path = path

    @classmethod
    def bind(cls, path: Path, fallback: str = "the controller polls") -> WakeListener | None:
        """Bind the socket at ``path`` (replacing a stale one a dead process left); None if this
        host cannot, and the caller then polls (``fallback`` says how, for the log)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(str(path))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.warning("no wake-up socket at %s (%s): %s", path, exc, fallback)
            return None
        return cls(sock, path)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a poke; drain every queued one (they collapse)."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not ready:
            return False
        self._drain()
        return True

    async def wait_async(self, timeout: float) -> bool:
        """``wait`` without blocking the event loop (a tenant's worker keeps receiving meanwhile)."""
        if self.wait(0):
            return True
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, max(0.0, timeout))
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
        self._drain()
        return True

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.sock.recv(16)

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            if self.path.exists():
                os.unlink(self.path)


class WakeSender:
    """A tenant's end: ``poke()`` after each demand write; never blocks, never raises."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sent = 0

    def poke(self) -> bool:
        """True when the datagram reached a listener."""
        if self.sock is None:
            return False
        try:
            self.sock.sendto(b"w", self.path)
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError):
            return False  # no controller (yet, or any more), or it has wake-ups queued already
        except OSError as exc:  # e.g. a path longer than sun_path: it can never work, stop trying
            log.warning("partition wake-up to %s disabled (%s)", self.path, exc)
            self.close()
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
