"""`easerve serve -f SPEC` as a subprocess, for tests that drive a whole deployment over HTTP.

One copy of the start-wait-stop dance: the process gets its own session (so its workers can be
killed as a group), the caller gets (port, workdir) once the launcher logged "serving at", and
on exit it is stopped with SIGTERM (its drain) and SIGKILLed if it outlives a minute. When it
does not come up, the error carries the tail of its log and of every worker's log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from easerve_runtime.workers.launcher import free_port


@contextmanager
def serve_process(spec_text: str, tmp: Path, env: Mapping[str, str] | None = None,
                  timeout_s: float = 400.0,
                  on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Iterator[tuple[int, Path]]:
    """Serve ``spec_text`` (an EPDDeployment manifest) from ``tmp``; yields (HTTP port, workdir).

    ``tmp`` must exist; the spec is written to ``tmp/spec.yaml``, the launcher's output to
    ``tmp/serve.log`` (tests that check what it logged read it there), the workdir is ``tmp/wd``.

    ``on_start`` is called with the ``easerve serve`` Popen as soon as it is started, for tests
    that signal the launcher themselves (SIGTERM mid-load, then check its exit status or how long
    it took). Stopping it here on exit is then a no-op: a Popen that has exited is not signalled.
    """
    spec = tmp / "spec.yaml"
    spec.write_text(spec_text)
    port = free_port()
    workdir = tmp / "wd"
    logpath = tmp / "serve.log"
    with open(logpath, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "easerve_operator.cli", "serve", "-f", str(spec), "--port", str(port),
             "--workdir", str(workdir)],
            env=dict(os.environ, **(env or {})), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    try:
        if on_start is not None:
            on_start(proc)
        while "serving at" not in logpath.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                logs = "".join(p.read_text(errors="replace")[-1500:] for p in workdir.glob("*.log"))
                raise RuntimeError(f"easerve serve did not come up:\n{logpath.read_text()[-2000:]}\n{logs}")
            time.sleep(0.3)
        yield port, workdir
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
