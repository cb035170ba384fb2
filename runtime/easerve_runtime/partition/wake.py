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

Either side degrades to the old behaviour rather than failing: a controller that cannot bind the
socket (a path longer than ``sun_path``, an unsupported filesystem) polls at its tick, and a
tenant whose datagram finds no listener (no controller, or one that died) carries on: the
record's share rules (``workers.partition_link``) already cover a missing controller.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def wake_path(control: Path) -> Path:
    """The socket beside a GPU's control record (``record.control_path``)."""
    return control.with_name(control.name + ".wake")


class WakeListener:
    """The controller's end: ``wait(timeout)`` returns True when a tenant poked, False on timeout."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.sock = sock
        self.path = path

    @classmethod
    def bind(cls, path: Path) -> WakeListener | None:
        """Bind the socket at ``path`` (replacing a stale one a dead controller left); None if this
        host cannot, and the controller then polls."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(str(path))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            log.warning("no wake-up socket at %s (%s): the controller polls", path, exc)
            return None
        return cls(sock, path)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a poke; drain every queued one (they collapse)."""
        ready, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self.sock.recv(16)
        return True

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
