"""Run ONE stage process: what a pod container runs (``easerve worker --stage S --config F``).

Order of operations matters for correctness, not style:

- start: create the runtime, build the engine and the downstream pools, start the batch loop,
  register the endpoint, and only then ``set_health_status(True)`` (Kubernetes readiness);
- stop (SIGTERM/SIGINT): ``runtime.shutdown()`` withdraws the discovery key first (so no client
  picks this instance any more), Dynamo then waits for in-flight handlers (graceful shutdown),
  and our batch loop keeps running until they are done; only then does the process exit.
  The frontend instead stops accepting HTTP connections, waits for in-flight requests, and then
  shuts its runtime down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from easerve_runtime.api import Backend, EPDDeploymentSpec, RuntimeConfig
from easerve_runtime.metrics import Metrics
from easerve_runtime.policies.router import process_rotation_start
from easerve_runtime.topology import PARTITION_GPU_ENV, frontends_ranked, local_prefill_in_encode, plan
from easerve_runtime.workers.dynamo_rt import (
    COMPONENT_DECODE,
    COMPONENT_ENCODE,
    COMPONENT_PREFILL,
    DEFAULT_SYSTEM_PORT,
    default_local_key,
    dynamo_env,
    endpoint_path,
    install_stop_handlers,
    local_prefill_component,
    make_runtime,
    wait_for_discovery,
)
from easerve_runtime.workers.pool import Pool

log = logging.getLogger("easerve.worker")

STAGES = ("encode", "prefill", "decode", "frontend", "local-prefill", "aggregated")
OMNI_STAGES = ("omni-shared", "omni-downstream")
DRAIN_TIMEOUT_S = 60.0
CONFIG_POLL_S = 1.0
"""How often a worker stats its config file for a live knob change (one stat call; a kubelet
refreshes a ConfigMap volume about once a minute, so a second adds nothing noticeable)."""


class ConfigFollower:
    """Follows the mounted config file as a kubelet refreshes a ConfigMap volume.

    The kubelet writes a new timestamped directory and swaps the ``..data`` symlink atomically;
    ``config.json`` is a symlink through it, so ``os.stat`` (which follows links) sees a new inode.
    A plain rewrite (``easerve serve``'s local file) changes mtime/size instead. Either way one
    cheap stat per poll; the file is read and parsed only when that signature moved. A file that
    does not parse (a rewrite caught half-way, or a bad edit) is skipped and retried at the next
    change; it never stops the worker.
    """

    def __init__(self, path: str, spec: EPDDeploymentSpec) -> None:
        self.path = path
        self.spec = spec
        self._sig = self._stat()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(self) -> Any:
        """The ``KnobChange`` since the last good read, or None when nothing (readable) changed."""
        from pydantic import ValidationError

        from easerve_runtime.policies.knobs import diff_knobs

        sig = self._stat()
        if sig is None or sig == self._sig:
            return None
        try:
            with open(self.path) as f:
                new = RuntimeConfig.from_json(f.read())
        except (OSError, ValueError, ValidationError) as exc:
            log.warning("config %s changed but does not load (%s); keeping the running knobs", self.path, exc)
            return None
        self._sig = sig
        change = diff_knobs(self.spec, new.spec)
        self.spec = new.spec
        return change


async def follow_config(follower: ConfigFollower, worker: Any, metrics: Metrics) -> None:
    """Apply live knob changes of the config file to ``worker`` (an EncodeWorker); log the rest."""
    while True:
        await asyncio.sleep(CONFIG_POLL_S)
        change = follower.poll()
        if change is None or change.empty:
            continue
        if change.roll:
            log.warning("config changed; not applied live, needs a roll: %s", ", ".join(change.roll))
            metrics.knob_updates.labels("roll").inc()
        if change.live:
            worker.apply_knobs(change)


def make_engine(spec: EPDDeploymentSpec, stage: str) -> Any:
    """The engine for this stage, by ``spec.engine.backend``; for ``aggregated`` the
    (encoder, prefiller, decoder) triple of one process."""
    backend = str(spec.engine.backend)
    if stage == "aggregated":
        if backend == Backend.SIM:
            from easerve_runtime.engines.sim import SimEngine

            sim = SimEngine.for_spec(spec, stage)
            return sim, sim, sim
        if backend == Backend.TORCH:
            from easerve_runtime.engines.torch import make_aggregated_engines

            return make_aggregated_engines(spec)
    if backend == Backend.SIM:
        from easerve_runtime.engines.sim import SimEngine

        return SimEngine.for_spec(spec, stage)
    if backend == Backend.TORCH:
        from easerve_runtime.engines.torch import make_torch_engine

        return make_torch_engine(spec, stage)
    raise ValueError(f"spec.engine.backend: {backend!r} is not supported by the runtime yet (use sim)")


PARTITION_SHM_ENV = "EASERVE_PARTITION_SHM"
"""Where partition records live (default /dev/shm); ``PARTITION_GPU_ENV`` (from the topology)
says which GPUs' records this worker uses: one index, or a comma list for a local prefill
worker spanning several encode GPUs (default 0)."""


def _prefill_tp(spec: EPDDeploymentSpec, stage: str) -> int:
    """The TP of a prefill worker of ``stage``: the remote pool's from the allocation, a local one's
    from the layout (its encode pod's GPUs); 1 when the layout cannot be read here."""
    if stage == "prefill":
        return int(spec.allocation.prefill.tensor_parallel)
    try:
        return int(plan(spec).local_prefill_tp)
    except (ValueError, OSError, KeyError):
        return 1


def partition_link(spec: EPDDeploymentSpec, stage: str) -> Any:
    """The shm link to the pod's partition controller(s), for encode and local prefill when partitioned."""
    if stage not in ("encode", "local-prefill") or not spec.has_local_prefill:
        return None
    if str(spec.sm_partition.mode) == "none":
        return None
    from easerve_runtime.partition.record import SHM_DIR
    from easerve_runtime.workers.partition_link import PartitionGroupLink, PartitionLink

    gpus = [int(g) for g in os.environ.get(PARTITION_GPU_ENV, "0").split(",") if g.strip()] or [0]
    shm = Path(os.environ.get(PARTITION_SHM_ENV) or SHM_DIR)
    role = "primary" if stage == "encode" else "partner"
    if len(gpus) > 1:
        return PartitionGroupLink(gpus, role, shm)
    return PartitionLink(gpus[0], role, shm)


async def run_stage(
    stage: str,
    cfg: RuntimeConfig,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
    local_key: str | None = None,
    discovery: str | None = None,
    config_path: str | None = None,
) -> int:
    if stage not in STAGES:
        raise ValueError(f"--stage: unknown stage {stage!r} (one of {', '.join(STAGES)})")
    if stage != "frontend":
        os.environ.setdefault("DYN_SYSTEM_PORT", str(DEFAULT_SYSTEM_PORT))
    # Discovery first: a worker that cannot reach it says so (log + not-ready probe) and retries.
    probe_port = port if stage == "frontend" else int(os.environ["DYN_SYSTEM_PORT"])
    probe_host = host if stage == "frontend" else os.environ.get("DYN_SYSTEM_HOST", "0.0.0.0")
    await wait_for_discovery({**os.environ, **dynamo_env(cfg, discovery)}, probe_port, probe_host)
    runtime = make_runtime(cfg, discovery)
    stop = asyncio.Event()
    install_stop_handlers(stop.set)
    metrics = Metrics()
    ns = cfg.dynamo_namespace
    spec = cfg.spec
    key = local_key or default_local_key()

    async def pool(component: str, name: str) -> Pool:
        client = await runtime.endpoint(endpoint_path(ns, component)).client()
        return Pool(client, name, rotation_start=process_rotation_start(f"{socket.gethostname()}:{os.getpid()}"))

    if stage == "frontend":
        return await _run_frontend(
            cfg, runtime, await pool(COMPONENT_ENCODE, "encode"), metrics, stop, host, port
        )

    # the torch engine's encode process also runs its GPU's local prefill worker (one process, one
    # loop, one GreenContextPool for both engines): see topology.local_prefill_in_encode
    hosted = stage == "encode" and local_prefill_in_encode(spec)
    local_engine: Any = None
    if hosted:
        from easerve_runtime.engines.torch import colocated_engines

        engine, local_engine = colocated_engines(spec)
    else:
        engine = make_engine(spec, stage)
    link = partition_link(spec, stage)
    worker: Any
    local_worker: Any = None
    if stage == "aggregated":  # serves the encode component: the frontend reaches it unchanged
        from easerve_runtime.workers.aggregated import AggregatedWorker

        component = COMPONENT_ENCODE
        worker = AggregatedWorker.for_spec(spec, engine, metrics)
    elif stage == "decode":
        from easerve_runtime.workers.decode import DecodeWorker

        component = COMPONENT_DECODE
        worker = DecodeWorker.for_spec(spec, engine, metrics)
    elif stage in ("prefill", "local-prefill"):
        from easerve_runtime.workers.prefill import PrefillWorker, profile_prefill

        component = COMPONENT_PREFILL if stage == "prefill" else local_prefill_component(key)
        decode_pool = await pool(COMPONENT_DECODE, "decode")
        worker = PrefillWorker(
            engine,
            metrics,
            decode_pool,
            stage=stage,
            max_batch_tokens=spec.prefill.max_batch_tokens,
            partition=link,
            profile_cost=profile_prefill(spec, _prefill_tp(spec, stage)),
        )
    else:
        from easerve_runtime.workers.encode import EncodeWorker

        s = spec.offload.ratio
        remote = await pool(COMPONENT_PREFILL, "prefill") if s > 0 else None
        local: Any = None
        if hosted:
            from easerve_runtime.workers.pool import InProcessPool
            from easerve_runtime.workers.prefill import PrefillWorker, profile_prefill

            local_worker = PrefillWorker(
                local_engine,
                metrics,
                await pool(COMPONENT_DECODE, "decode"),
                stage="local-prefill",
                max_batch_tokens=spec.prefill.max_batch_tokens,
                partition=partition_link(spec, "local-prefill"),
                profile_cost=profile_prefill(spec, _prefill_tp(spec, "local-prefill")),
            )
            local = InProcessPool(local_worker)
        elif s < 1:
            local = await pool(local_prefill_component(key), "local prefill")
            await _wait_for_partner(local, local_prefill_component(key))
        component = COMPONENT_ENCODE
        worker = EncodeWorker(spec, engine, metrics, remote, local, partition=link)

    endpoint = runtime.endpoint(endpoint_path(ns, component))
    endpoint.metrics.register_prometheus_expfmt_callback(metrics.exposition)
    loop_task = asyncio.create_task(worker.run(), name=f"{stage}-loop")
    loops = {loop_task}
    if local_worker is not None:
        loops.add(asyncio.create_task(local_worker.run(), name="local-prefill-loop"))
    follow_task = None
    if stage == "encode" and config_path is not None:  # the only stage with live knobs
        follower = ConfigFollower(config_path, spec)
        follow_task = asyncio.create_task(follow_config(follower, worker, metrics), name="config-follow")
    serve_task = asyncio.ensure_future(endpoint.serve_endpoint(worker.generate, graceful_shutdown=True))
    runtime.set_health_status(True)
    log.info("%s worker serving %s", stage, endpoint_path(ns, component))
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({serve_task, *loops, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    for t in loops & done:
        if t.exception() is not None:
            log.error("%s died: %r", t.get_name(), t.exception())
            rc = 1
    runtime.set_health_status(False)
    if stage == "local-prefill" and rc == 0:
        await _stay_discoverable_while_partner_drains(worker)
    runtime.shutdown()  # withdraw discovery, then Dynamo drains in-flight handlers
    try:
        # a dead in-process local prefill drains nothing (its requests wait on it): exit now, so
        # callers' streams break (an explicit error each) and the supervisor restarts the process
        await asyncio.wait_for(serve_task, DRAIN_TIMEOUT_S if rc == 0 or local_worker is None else 1.0)
    except (TimeoutError, Exception) as exc:  # noqa: BLE001 - report and exit either way
        if not isinstance(exc, asyncio.CancelledError):
            log.warning("%s: drain ended with %r", stage, exc)
    for t in (*loops, stop_task, follow_task):
        if t is not None:
            t.cancel()
    return rc


PARTNER_IDLE_S = 2.0


async def _wait_for_partner(local: Pool, component: str) -> None:
    """An encode worker registers only once its pod's local prefill is discoverable.

    Both containers start together; an encode worker discoverable first would take requests whose
    local share fails with "no live local prefill instance" (seen on every new pod of a rolling
    update). Logged while waiting, so a missing partner is never silent."""
    t0 = time.monotonic()
    next_log = t0
    while not local.instances():
        if time.monotonic() >= next_log:
            log.info("encode: waiting for this pod's local prefill (%s) before registering", component)
            next_log += 10.0
        await asyncio.sleep(0.1)


async def _stay_discoverable_while_partner_drains(worker: Any) -> None:
    """Keep a local prefill worker discoverable until its encode partner has drained.

    Kubernetes sends SIGTERM to every container of a pod at once. The encode worker withdraws from
    discovery at once (no new requests reach it) but still drains its admitted batches, and those
    need this pod's local prefill: withdrawing here too would fail them with "no live local prefill
    instance" during every rolling update. So this worker stays registered (already not-ready) until
    it has had no work for ``PARTNER_IDLE_S``, or the drain deadline passes.
    """
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    idle_since: float | None = None
    while time.monotonic() < deadline:
        busy = bool(getattr(worker, "inflight", 0))
        now = time.monotonic()
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= PARTNER_IDLE_S:
            return
        await asyncio.sleep(0.05)


async def _run_frontend(
    cfg: RuntimeConfig,
    runtime: Any,
    encode: Pool,
    metrics: Metrics,
    stop: asyncio.Event,
    host: str,
    port: int,
) -> int:
    from aiohttp import web

    from easerve_runtime.workers.frontend import FRONTENDS_ENV, Frontend

    fe = Frontend(cfg, encode, metrics)
    ranking = None
    if os.environ.get(FRONTENDS_ENV) == "1":
        # `easerve serve`: the client reaches one frontend, which admits for all; it starts where the
        # twin's one door starts (the other frontends of the host see no traffic to rank against)
        encode.set_rank(0, 1)
    elif frontends_ranked(cfg.spec):
        from easerve_runtime.workers.frontend_rank import FrontendRank

        ranking = FrontendRank(runtime, cfg.dynamo_namespace, encode)
        await ranking.start()
    runner = web.AppRunner(fe.app(), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    runtime.set_health_status(True)
    log.info("frontend listening on http://%s:%d", host, port)
    await stop.wait()
    fe.draining = True
    await site.stop()  # no new connections; in-flight handlers continue
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while fe.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
    if ranking is not None:
        await ranking.stop()
    runtime.shutdown()
    return 0


def run(stage: str, config_path: str, **kw: Any) -> int:
    """Load the ConfigMap JSON and run the stage until stopped."""
    from pydantic import ValidationError

    from easerve_runtime.api import spec_errors

    try:
        with open(config_path) as f:
            cfg = RuntimeConfig.from_json(f.read())
    except OSError as exc:
        raise SystemExit(f"--config {config_path}: {exc.strerror}") from None
    except ValidationError as exc:
        lines = "\n  ".join(spec_errors(exc, prefix="config"))
        raise SystemExit(f"--config {config_path}: invalid runtime config:\n  {lines}") from None
    if stage in OMNI_STAGES:  # the omni-colocated runtime has its own process model
        from easerve_runtime.workers.omni import run_stage as run_omni

        port = kw.get("port") if stage == "omni-shared" else None
        return run_omni(stage, cfg.name, cfg.spec, port)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop ships with ai-dynamo-runtime
        pass
    return asyncio.run(run_stage(stage, cfg, config_path=config_path, **kw))
