"""Loaded by every Python process the kubelet harness starts (e2e/process_runner.py puts this folder
first on PYTHONPATH): the pod network stand-in.

Pods here share the host's network namespace, each with its own loopback address as pod IP. A
process that listens on the wildcard address (``0.0.0.0``, ``""``), as it would inside a real pod,
would clash with the same port of every other pod; this turns such a bind into a bind on the pod IP
(``EASERVE_HARNESS_POD_IP``). Nothing else changes. Outside the harness the variable is unset and
this file does nothing.
"""

import os
import socket

_POD_IP = os.environ.get("EASERVE_HARNESS_POD_IP")

if _POD_IP:
    _bind = socket.socket.bind

    def _pod_bind(self, address, _bind=_bind, _ip=_POD_IP):  # type: ignore[no-untyped-def]
        if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] in ("0.0.0.0", ""):
            address = (_ip, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _pod_bind  # type: ignore[method-assign]
