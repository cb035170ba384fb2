"""The kubelet harness's KUBELET API: the HTTPS endpoint the apiserver calls for pod logs (e2e only).

``kubectl logs`` (and the client's ``read_namespaced_pod_log``) do not read logs from the apiserver:
the apiserver proxies them to the node's kubelet, at ``https://<node InternalIP>:<daemonEndpoints.
kubeletEndpoint.Port>/containerLogs/<namespace>/<pod>/<container>``. The kubelet harness plays that
kubelet, so it serves this one path from the process runner's log files (``ProcessRunner.log_path``):

* ``tailLines=N`` (the last N lines), ``limitBytes=N`` (at most N bytes), ``follow=true`` (stream
  what the container writes until it stops or the client goes away); ``timestamps`` and ``previous``
  are accepted and ignored (the harness appends a container's restarts to one file);
* the harness's own ``--- <time> ...`` lines (start, exit, preStop, probe kills) are left out, so a
  container's output reads as it would from a container runtime;
* 404 for a pod or container the runner does not know.

TLS: the apiserver always speaks HTTPS to kubelets; without ``--kubelet-certificate-authority`` it does
not verify the serving certificate (k8s-up.sh sets none), so a self-signed one, made once per server
with ``openssl``, is enough. No client authentication is asked for: this is a test harness on loopback.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("kubelet_harness.api")

LOG_PATH = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/]+)$")
SEPARATOR = re.compile(rb"^--- \d{4}-\d\d-\d\dT\S+ ")
"""The process runner's own lines (start, exit, preStop, probe kills): one line each, never a container's."""
FOLLOW_POLL_S = 0.2


def self_signed_cert(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A throw-away serving certificate for ``host`` (openssl, 1 day)."""
    crt, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=kubelet-harness", "-addext", f"subjectAltName=IP:{host}",
            "-keyout", str(key), "-out", str(crt),
        ],
        check=True,
        capture_output=True,
    )
    return crt, key


def read_log(path: Path, tail_lines: int | None = None, limit_bytes: int | None = None) -> bytes:
    """A container's log as a container runtime would give it: without the harness's separators."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return b""
    lines = [ln for ln in raw.splitlines(keepends=True) if not SEPARATOR.match(ln)]
    if tail_lines is not None:
        lines = lines[-tail_lines:] if tail_lines > 0 else []
    out = b"".join(lines)
    return out[:limit_bytes] if limit_bytes is not None else out


class KubeletApi:
    """Serves ``/containerLogs`` for one harness node (see the module docstring)."""

    def __init__(
        self,
        log_path: Callable[[str, str, str], Path | None],
        running: Callable[[str, str], bool],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.log_path, self.running = log_path, running
        self.host = host
        self._dir = Path(tempfile.mkdtemp(prefix="easerve-kubelet-api-"))
        crt, key = self_signed_cert(self._dir, host)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(crt), str(key))
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: object) -> None:
                log.debug("kubelet api: " + fmt, *args)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                api.handle(self)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> KubeletApi:
        self._thread = threading.Thread(target=self._server.serve_forever, name="kubelet-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------ requests
    def handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        m = LOG_PATH.match(url.path)
        if m is None:
            self._send(req, 404, b"not found: the kubelet harness serves /containerLogs only\n")
            return
        ns, pod, container = m.groups()
        path = self.log_path(ns, pod, container)
        if path is None:
            self._send(req, 404, f"pod {ns}/{pod} container {container} is not on this node\n".encode())
            return
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            tail = int(q["tailLines"]) if "tailLines" in q else None
            limit = int(q["limitBytes"]) if "limitBytes" in q else None
        except ValueError:
            self._send(req, 400, b"tailLines and limitBytes must be integers\n")
            return
        body = read_log(path, tail, limit)
        if q.get("follow", "false").lower() != "true":
            self._send(req, 200, body)
            return
        req.send_response(200)
        req.send_header("Content-Type", "text/plain")
        req.send_header("Transfer-Encoding", "chunked")
        req.end_headers()
        with contextlib.suppress(OSError):
            for chunk in self._follow(path, body, ns, pod):
                req.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                req.wfile.flush()
            req.wfile.write(b"0\r\n\r\n")

    def _follow(self, path: Path, first: bytes, ns: str, pod: str) -> Iterator[bytes]:
        if first:
            yield first
        offset = path.stat().st_size if path.exists() else 0
        while not self._stop.is_set():
            size = path.stat().st_size if path.exists() else 0
            if size > offset:
                with open(path, "rb") as f:
                    f.seek(offset)
                    new = f.read(size - offset)
                offset = size
                kept = b"".join(ln for ln in new.splitlines(keepends=True) if not SEPARATOR.match(ln))
                if kept:
                    yield kept
            elif not self.running(ns, pod):
                return
            time.sleep(FOLLOW_POLL_S)

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, code: int, body: bytes) -> None:
        req.send_response(code)
        req.send_header("Content-Type", "text/plain")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)
