"""Dynamo plumbing shared by every stage: environment, runtime, endpoint names, shutdown.

Why a module of its own: the discovery backend, the request-plane limits and the shutdown order
are the three things that, done wrong, make a Dynamo deployment hang (a lingering discovery key
sends clients to a dead instance; NATS' 1 MB cap drops image requests). Keeping them here means
every stage gets them right the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from easerve_runtime.api import SYSTEM_PORT, DiscoveryBackend, RuntimeConfig

log = logging.getLogger("easerve.runtime")

TCP_MAX_MESSAGE_SIZE = 512 * 1024 * 1024
"""Default for DYN_TCP_MAX_MESSAGE_SIZE: one envelope of a 64-image micro-batch for a 34B model
(64 x 576 x 7168 x 2 bytes = 528 MB before padding) must fit in one request-plane message."""

DEFAULT_FILE_KV = "/tmp/easerve-kv"
DEFAULT_SYSTEM_PORT = SYSTEM_PORT

COMPONENT_ENCODE = "encode"
COMPONENT_PREFILL = "prefill"
COMPONENT_DECODE = "decode"
LOCAL_PREFILL_PREFIX = "local_prefill_"
ENDPOINT = "generate"


def sanitize(key: str) -> str:
    """Dynamo path segments: letters, digits and underscores only."""
    return re.sub(r"[^A-Za-z0-9_]", "_", key) or "_"


def endpoint_path(namespace: str, component: str) -> str:
    return f"{namespace}.{component}.{ENDPOINT}"


def local_prefill_component(local_key: str) -> str:
    """The component of the local prefill worker that shares the encode GPU keyed ``local_key``.

    Each encode pod has its own, so the key must be unique per pod: the pod name (which is also
    its hostname) in Kubernetes, ``e<i>`` under ``easerve serve``.
    """
    return LOCAL_PREFILL_PREFIX + sanitize(local_key)


def default_local_key() -> str:
    return os.environ.get("POD_NAME") or os.uname().nodename


def dynamo_env(
    cfg: RuntimeConfig, discovery: str | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The DYN_* variables this process needs, without overriding what the operator already set.

    ``discovery`` overrides ``spec.discovery.backend`` (``easerve serve`` forces ``file``).
    """
    env = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}
    backend = discovery or str(cfg.spec.discovery.backend)
    if backend not in {b.value for b in DiscoveryBackend} | {"mem"}:
        raise ValueError(f"spec.discovery.backend: unsupported {backend!r} (etcd, kubernetes or file)")
    out["DYN_DISCOVERY_BACKEND"] = backend
    if backend == DiscoveryBackend.FILE and not env.get("DYN_FILE_KV"):
        out["DYN_FILE_KV"] = str(Path(DEFAULT_FILE_KV) / cfg.dynamo_namespace)
    if (
        backend == DiscoveryBackend.ETCD
        and cfg.spec.discovery.etcd_endpoints
        and not env.get("ETCD_ENDPOINTS")
    ):
        out["ETCD_ENDPOINTS"] = cfg.spec.discovery.etcd_endpoints
    if backend == DiscoveryBackend.KUBERNETES:
        missing = [k for k in ("POD_NAME", "POD_NAMESPACE", "POD_UID") if not env.get(k)]
        if missing:
            raise ValueError(
                f"spec.discovery.backend=kubernetes needs {', '.join(missing)} in the environment (downward API)"
            )
    out.setdefault("DYN_REQUEST_PLANE", env.get("DYN_REQUEST_PLANE", "tcp"))
    if not env.get("DYN_TCP_MAX_MESSAGE_SIZE"):
        out["DYN_TCP_MAX_MESSAGE_SIZE"] = str(TCP_MAX_MESSAGE_SIZE)
    if not env.get("DYN_TCP_REQUEST_TIMEOUT"):
        # Dynamo's default (10 s) would fail an accepted request that waits in a queue longer than
        # that: the hop's timeout is the request's own deadline instead (spec.limits)
        out["DYN_TCP_REQUEST_TIMEOUT"] = str(math.ceil(cfg.spec.limits.request_timeout_seconds))
    if not env.get("DYN_LOG"):
        # Dynamo logs every routed request at INFO; its etcd client's warnings name the endpoint
        # when discovery goes away and comes back, which an operator needs to see.
        out["DYN_LOG"] = "error,dynamo_runtime::transports::etcd=warn"
    return out


DEFAULT_ETCD_ENDPOINT = "http://localhost:2379"
"""What Dynamo's etcd client uses when ETCD_ENDPOINTS is unset."""


def etcd_endpoints(env: Mapping[str, str]) -> list[str]:
    """The etcd endpoints Dynamo will use (ETCD_ENDPOINTS is comma-separated)."""
    raw = env.get("ETCD_ENDPOINTS") or DEFAULT_ETCD_ENDPOINT
    return [e.strip() for e in raw.split(",") if e.strip()]


async def _reachable(endpoint: str, timeout: float) -> str | None:
    """None when a TCP connection to the endpoint opens, else the reason it did not."""
    from urllib.parse import urlsplit

    u = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    host, port = u.hostname or "localhost", u.port or 2379
    try:
        _, w = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    w.close()
    return None


async def wait_for_discovery(
    env: Mapping[str, str],
    probe_port: int | None,
    probe_host: str = "0.0.0.0",
    max_interval_s: float = 5.0,
) -> None:
    """Block until the discovery service answers, saying so in the log and on the probes.

    Dynamo's DistributedRuntime blocks its event loop while it retries etcd for up to two minutes,
    with its warnings hidden at our default log level: a worker with a wrong or missing endpoint
    would hang silently, neither ready nor failing. So before creating the runtime, this checks the
    etcd endpoints itself and, while none answers, logs one WARNING per attempt naming the endpoints
    and keeps retrying (back-off up to ``max_interval_s``), never giving up. Meanwhile it serves the
    pod's probe port: ``/live`` 200 (the process is fine, restarting it would not help) and
    ``/health`` 503 with the reason, so Kubernetes shows the pod not-ready instead of restarting it.
    Other backends (kubernetes, file) return at once.
    """
    if env.get("DYN_DISCOVERY_BACKEND") != DiscoveryBackend.ETCD:
        return
    endpoints = etcd_endpoints(env)
    reason = ""
    for ep in endpoints:
        r = await _reachable(ep, 2.0)
        if r is None:
            return
        reason = r
    from aiohttp import web

    state = {"reason": reason}

    async def health(_: web.Request) -> web.Response:
        return web.json_response(
            {"status": "notready", "discovery": "etcd", "endpoints": endpoints, "error": state["reason"]},
            status=503,
        )

    async def live(_: web.Request) -> web.Response:
        return web.json_response({"status": "live"})

    runner: web.AppRunner | None = None
    if probe_port:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/live", live)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, probe_host, probe_port).start()
        except OSError as exc:
            log.warning("discovery wait: cannot serve probes on %s:%d (%s)", probe_host, probe_port, exc)
    delay, attempt = 0.5, 0
    try:
        while True:
            attempt += 1
            log.warning(
                "discovery: etcd at %s is unreachable (%s); not ready, retrying in %.1fs (attempt %d)",
                ",".join(endpoints), state["reason"], delay, attempt,
            )
            await asyncio.sleep(delay)
            delay = min(max_interval_s, delay * 2)
            for ep in endpoints:
                r = await _reachable(ep, 2.0)
                if r is None:
                    log.info("discovery: etcd at %s answers; starting the runtime", ep)
                    return
                state["reason"] = r
    finally:
        if runner is not None:
            await runner.cleanup()


def on_context_stop(context: Any, callback: Callable[[], None]) -> asyncio.Task[None] | None:
    """Run ``callback`` once the request's Dynamo ``context`` is stopped or killed by its caller;
    the task to cancel when the request ends. None for a handler called without such a context
    (in-process tests)."""
    wait = getattr(context, "async_killed_or_stopped", None)
    if not callable(wait):
        return None

    async def watch() -> None:
        try:
            await wait()
        except Exception:  # noqa: BLE001 - a context that cannot be watched cancels nothing
            return
        callback()

    return asyncio.ensure_future(watch())


def request_context(client: Any) -> Any | None:
    """A fresh Dynamo ``Context`` for one call through ``client``, or None for a client that is not
    Dynamo's (the tests' in-process fakes). The caller stops it (``stop_generating``) when it gives
    up on the stream, which is how the worker at the other end learns that nobody listens any
    more (a client disconnect reaches every stage behind the frontend)."""
    try:
        from dynamo._core import Client, Context
    except ImportError:  # pragma: no cover - the runtime is a dependency
        return None
    return Context() if isinstance(client, Client) else None


def make_runtime(cfg: RuntimeConfig, discovery: str | None = None) -> Any:
    """Create the DistributedRuntime on the running loop, with the environment set first."""
    env = dynamo_env(cfg, discovery)
    os.environ.update(env)  # before the first dynamo import: it reads DYN_* at import time
    from dynamo.runtime import DistributedRuntime

    if env["DYN_DISCOVERY_BACKEND"] == DiscoveryBackend.FILE:
        Path(os.environ["DYN_FILE_KV"]).mkdir(parents=True, exist_ok=True)
    loop = asyncio.get_running_loop()
    return DistributedRuntime(loop, env["DYN_DISCOVERY_BACKEND"], env["DYN_REQUEST_PLANE"])


def install_stop_handlers(on_stop: Callable[[], None]) -> None:
    """Call ``on_stop`` once on SIGTERM or SIGINT (Kubernetes sends SIGTERM, Ctrl-C sends SIGINT)."""
    loop = asyncio.get_running_loop()
    fired = False

    def handler() -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        log.info("stop signal: draining in-flight requests")
        on_stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler)


def is_unavailable(exc: BaseException) -> bool:
    """Whether a Dynamo call failed before reaching the instance (safe to retry elsewhere)."""
    msg = str(exc).lower()
    return any(sig in msg for sig in _NOT_REACHED)


_NOT_REACHED = (
    "tcp connection to",  # "Unavailable: TCP connection to 127.0.0.1:N failed": nothing listens
    "before response stream was established",  # the instance was shutting down and refused it
    "connection refused",
    "no instances",
)
"""Dynamo error texts meaning the request never reached a handler (1.6.1 wording)."""
