"""kopf handlers: the thin shell around ``loop.Reconciler`` (the reconcile loop as an object).

Shape of the loop:

* The owner handler (create / update of ``spec`` / resume after a restart) validates the spec,
  renders the children (pure), and applies only those that are missing or drifted. It never
  writes ``spec``; it writes ``status``.
* Child changes (Deployment, Service, ConfigMap) repair drift: a deleted or hand-edited child is
  re-applied from the owner's spec. Deployment changes refresh the owner's status, so conditions
  move Progressing -> Ready as pods become ready, with no polling. Children are watched by the
  operator's own ``informer.ChildInformer``, not by kopf (kopf's per-object machinery for the
  7 children of every owner was most of the operator's memory and time; see informer.py). Pods
  are not watched: every few seconds one list of unbound pods (for all owners) finds those the
  scheduler cannot place, to report InsufficientCapacity.
* A kopf *index* keeps owners (as compressed JSON) and the informer keeps children, so the hot
  path reads memory, not the API server; after a restart the owner handler waits for the
  children's first list, which is why a resume writes nothing when nothing changed.

The ``Reconciler`` lives in kopf's memo (``memo.reconciler``; ``easerve operator`` injects one,
and the startup handler makes one when kopf is run on this file directly). Handlers here only
translate kopf's arguments.

Thread safety: kopf runs the sync handlers on a thread pool while its event loop updates the
indexes. Iterating an index from a handler thread raced with those updates (``RuntimeError:
dictionary changed size during iteration`` with several objects created within a second), so
every index read goes through ``memo.read``, which runs it *on the event loop thread*, where
the indexes are written: a read sees the index between two updates, never during one. The
informer's cache has its own lock.

kopf keeps its own bookkeeping in ``status.kopf`` rather than in annotations, so the objects a
GitOps tool compares against Git carry no operator-written metadata.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import kopf
from easerve_runtime.api import (
    FINALIZER,
    GROUP,
    LABEL_DEPLOYMENT,
    PLURAL,
    VERSION,
    name_errors,
)

from easerve_operator.reconcile.defaults import OperatorDefaults, with_operator_defaults
from easerve_operator.reconcile.informer import ChildInformer, kube_sources
from easerve_operator.reconcile.kube import Kube, new_api_client
from easerve_operator.reconcile.loop import Owner, Reconciler, check_spec, pack, unpack
from easerve_operator.render import render_children

MANAGED_KEY, MANAGED_VALUE = "app.kubernetes.io/managed-by", "easerve-operator"
MANAGED = {MANAGED_KEY: MANAGED_VALUE}
OWNER_LABEL = LABEL_DEPLOYMENT
CAPACITY_CHECK_S = 5.0
LOOP_READ_TIMEOUT_S = 30.0
T = TypeVar("T")


@dataclass
class Options:
    """Set by ``easerve operator`` before kopf starts."""

    webhook: bool = False
    webhook_host: str = "127.0.0.1"
    webhook_port: int = 0
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_managed: str = "easerve.io"
    worker_limit: int = 0  # 0: unlimited (fastest); see --worker-limit
    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    defaults: OperatorDefaults = field(default_factory=OperatorDefaults)  # filled into specs before render


OPTIONS = Options()


class LoopReader:
    """Runs a short function on the event loop thread (where kopf writes its indexes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.get_ident()  # built on the loop thread, by the startup handler

    def __call__(self, fn: Callable[[], T]) -> T:
        if threading.get_ident() == self.thread:
            return fn()
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(timeout=LOOP_READ_TIMEOUT_S)


# ----------------------------------------------------------------------------------- indexes
@kopf.index(GROUP, VERSION, PLURAL)
def owners(namespace: str, name: str, body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {
        (namespace, name): {
            "uid": meta.get("uid"),
            "generation": meta.get("generation"),
            "deleting": bool(meta.get("deletionTimestamp")),
            "spec": pack(dict(body.get("spec") or {})),
            "status": pack({k: v for k, v in (body.get("status") or {}).items() if k != "kopf"}),
        }
    }


def _owner_from_index(memo: Any, owners: kopf.Index, key: tuple[str, str]) -> Owner | None:
    """The owner as kopf's index has it (read on the loop thread: ``memo.read``)."""

    def one() -> Any:
        store = owners.get(key)
        return next(iter(store), None) if store is not None else None

    entry = memo.read(one)
    if entry is None:
        return None
    return Owner(
        namespace=key[0],
        name=key[1],
        uid=str(entry["uid"]),
        generation=entry["generation"],
        spec=unpack(entry["spec"]),
        status=unpack(entry["status"]),
        deleting=bool(entry["deleting"]),
    )


# ----------------------------------------------------------------------------------- owner
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(
    namespace: str,
    name: str,
    body: kopf.Body,
    meta: kopf.Meta,
    memo: kopf.Memo,
    patch: kopf.Patch,
    **kwargs: Any,
) -> None:
    """Make the children match the spec; report what was done in status (in kopf's own patch)."""
    owner = Owner(
        namespace=namespace,
        name=name,
        uid=str(meta["uid"]),
        generation=meta.get("generation"),
        spec=dict(body.get("spec") or {}),
        status={k: v for k, v in (body.get("status") or {}).items() if k != "kopf"},
    )
    out = memo.reconciler.reconcile(
        owner, lambda: memo.informer.children(owner.key), status_via=lambda st: patch.status.update(st)
    )
    if out.apply_error:
        raise kopf.TemporaryError(out.apply_error, delay=10)


# ----------------------------------------------------------------------------------- children
def _on_child_change(memo: Any, owners: kopf.Index) -> Any:
    """What the informer calls (on its dispatcher threads) when a child changed or was deleted."""

    def on_change(key: tuple[str, str], kind: str, name: str, body: dict[str, Any] | None) -> None:
        rec: Reconciler = memo.reconciler
        owner = _owner_from_index(memo, owners, key)
        if owner is None or owner.deleting:
            return
        if rec.applied_generation(key) != owner.generation and not rec.child_drifted(owner, kind, name, body):
            return  # the owner handler is applying this generation and will write status itself
        rec.refresh(owner, lambda: memo.informer.children(key), repair=(kind, name, body))

    return on_change


@kopf.on.event(GROUP, VERSION, PLURAL)
async def owner_event(
    event: dict[str, Any], namespace: str, name: str, status: kopf.Status, owners: kopf.Index, memo: kopf.Memo,
    **_: Any,
) -> None:
    """Drop per-owner memory once an EPDDeployment is gone (long-running operators stay small);
    once the status handed to kopf's patch is seen, write what child events found meanwhile; when a
    HAS search ended (``status.tuning``: no new generation, so the spec handler does not run), apply
    the tuned values to the children (``reconcile.effective``)."""
    key = (namespace, name)
    rec: Reconciler = memo.reconciler
    if event.get("type") == "DELETED":
        rec.forget(key)
        return
    landed = rec.landed(key, (status or {}).get("observedGeneration"))
    owner = _owner_from_index(memo, owners, key)
    if owner is None or owner.deleting:
        return
    if rec.overlay_changed(owner):  # cheap: cached per generation and overlay
        out = await asyncio.to_thread(rec.reconcile, owner, lambda: memo.informer.children(key))
        if out.apply_error:
            logging.getLogger(__name__).error("%s/%s: applying the tuned values: %s", *key, out.apply_error)
    elif landed:
        await asyncio.to_thread(rec.refresh, owner, lambda: memo.informer.children(key))


class CapacitySweeper:
    """Every few seconds, one list of unbound pods for all owners (``Reconciler.capacity_sweep``)."""

    def __init__(self, memo: Any, owners: kopf.Index, namespaces: list[str] | None) -> None:
        self.memo, self.owners, self.namespaces = memo, owners, namespaces
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="capacity", daemon=True)

    def start(self) -> CapacitySweeper:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        rec: Reconciler = self.memo.reconciler
        while not self.stopped.wait(CAPACITY_CHECK_S):
            try:
                rec.capacity_sweep(
                    self.namespaces,
                    owner=lambda key: _owner_from_index(self.memo, self.owners, key),
                    children=lambda key: lambda: self.memo.informer.children(key),
                )
            except Exception:  # noqa: BLE001 - the next sweep tries again
                logging.getLogger(__name__).exception("capacity sweep failed")


def render_with_defaults(name: str, namespace: str, uid: str, spec: Any) -> list[dict[str, Any]]:
    """Render with the operator-wide defaults filled in (``reconcile/defaults.py``): the stored spec
    is never written, only the rendered copy carries e.g. the discovery etcd endpoints."""
    return render_children(name, namespace, uid, with_operator_defaults(spec, OPTIONS.defaults))


def watched_namespaces(namespaces: list[str]) -> list[str] | None:
    """The namespaces our own watches list, or None for all of them. kopf takes globs
    (``--namespace 'team-*'``); the API lists one literal namespace or all, so a glob is watched
    cluster-wide: children of namespaces kopf does not serve have no owner here and are ignored."""
    if not namespaces or any(ch in ns for ns in namespaces for ch in "*?[!"):
        return None
    return list(namespaces)


# ----------------------------------------------------------------------------------- admission
def validate(spec: kopf.Spec, name: str | None = None, **_: Any) -> None:
    """Refuse an invalid spec (or a name whose labels cannot be applied) at ``kubectl apply`` time,
    naming each offending field."""
    errors = name_errors(name or "")
    errors += check_spec(dict(spec))[1]
    if errors:
        raise kopf.AdmissionError("; ".join(errors), code=422)


def enable_webhook(host: str, port: int, cert: str | None, key: str | None) -> None:
    """Register the validating webhook; kopf refuses admission handlers without a server.

    Only CREATE and UPDATE are validated: an invalid object that got in while the webhook was
    down must stay deletable. Deletion needs no validation.
    """
    OPTIONS.webhook, OPTIONS.webhook_host, OPTIONS.webhook_port = True, host, port
    OPTIONS.webhook_cert, OPTIONS.webhook_key = cert, key
    kopf.on.validate(GROUP, VERSION, PLURAL, id="validate-spec", operations=["CREATE", "UPDATE"])(validate)


@kopf.on.cleanup()
def stop_informer(memo: kopf.Memo, **_: Any) -> None:
    for part in ("informer", "sweeper"):
        if part in memo:
            memo[part].stop()


# ----------------------------------------------------------------------------------- settings
@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, owners: kopf.Index, **_: Any) -> None:
    """Runs on the event loop: builds the reconciler (unless injected) and the loop reader."""
    if "reconciler" not in memo:
        memo.reconciler = Reconciler(client_factory=Kube, render=render_with_defaults)
    memo.read = LoopReader(asyncio.get_running_loop())
    if "informer" not in memo:
        memo.informer = ChildInformer(
            kube_sources(new_api_client(), f"{MANAGED_KEY}={MANAGED_VALUE}", watched_namespaces(OPTIONS.namespaces)),
            OWNER_LABEL,
            on_change=_on_child_change(memo, owners),
            is_known=memo.reconciler.seen,
        ).start()
    if "sweeper" not in memo:
        memo.sweeper = CapacitySweeper(memo, owners, watched_namespaces(OPTIONS.namespaces)).start()
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage()
    settings.persistence.progress_storage = kopf.StatusProgressStorage()
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # an Event per success is noise at 200+ objects
    # Per-object workers exit soon after their last event. `--worker-limit N` also caps how many
    # run at once, which bounds the event bodies in flight during a burst at a cost in speed
    # (200 creates: 195 MB / 10.3 s unlimited, 144 MB / 12.1 s at 48; docs/benchmarks.md).
    settings.batching.idle_timeout = 0.2
    if OPTIONS.worker_limit > 0:
        settings.batching.worker_limit = OPTIONS.worker_limit
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    if OPTIONS.webhook:
        settings.admission.server = kopf.WebhookServer(
            addr=OPTIONS.webhook_host,
            host=OPTIONS.webhook_host,
            port=OPTIONS.webhook_port,
            certfile=OPTIONS.webhook_cert,
            pkeyfile=OPTIONS.webhook_key,
        )
        settings.admission.managed = OPTIONS.webhook_managed
