"""kopf handlers: the thin shell around ``loop.Reconciler`` (the reconcile loop as an object).

Shape of the loop:

* The owner handler (create / update of ``spec`` / resume after a restart) validates the spec,
  renders the children (pure), and applies only those that are missing or drifted. It never
  writes ``spec``; it writes ``status``.
* Child events (Deployment, Service, ConfigMap) repair drift: a deleted or hand-edited child is
  re-applied from the owner's spec. Deployment events refresh the owner's status, so conditions
  move Progressing -> Ready as pods become ready, with no polling. Pods are not watched:
  while an owner is not Ready, a timer asks for its unbound pods to report InsufficientCapacity.
* kopf *indexes* keep an in-memory view of owners and children (as compressed JSON), so the hot
  path reads memory, not the API server; a restart re-lists them before any handler runs, which
  is why a resume writes nothing when nothing changed.

The ``Reconciler`` lives in kopf's memo (``memo.reconciler``; ``easerve operator`` injects one,
and the startup handler makes one when kopf is run on this file directly). Handlers here only
translate kopf's arguments.

Thread safety: kopf runs these sync handlers on a thread pool while its event loop updates the
indexes. Iterating an index from a handler thread raced with those updates (``RuntimeError:
dictionary changed size during iteration`` with several objects created within a second), so
every index read goes through ``memo.read``, which runs it *on the event loop thread*, where
the indexes are written: a read sees the index between two updates, never during one.

kopf keeps its own bookkeeping in ``status.kopf`` rather than in annotations, so the objects a
GitOps tool compares against Git carry no operator-written metadata.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import kopf
from easerve_runtime.api import (
    FINALIZER,
    GROUP,
    LABEL_DEPLOYMENT,
    PLURAL,
    VERSION,
    name_errors,
    parse_spec,
    spec_errors,
)
from pydantic import ValidationError

from easerve_operator.reconcile.kube import Kube
from easerve_operator.reconcile.loop import Children, Owner, Reconciler, pack, unpack

MANAGED = {"app.kubernetes.io/managed-by": "easerve-operator"}
OWNER_LABEL = LABEL_DEPLOYMENT
CHILD_KINDS = (
    ("", "v1", "configmaps", "ConfigMap"),
    ("", "v1", "services", "Service"),
    ("apps", "v1", "deployments", "Deployment"),
)
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


def _child_index(kind: str):  # type: ignore[no-untyped-def]
    def index(namespace: str, name: str, body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[Any, Any]:
        owner = labels.get(OWNER_LABEL)
        if not owner:
            return {}
        return {(namespace, owner): {"kind": kind, "name": name, "body": pack(_trim(body))}}

    return index


def _trim(body: kopf.Body) -> dict[str, Any]:
    """What drift checks and status need of a child; managedFields alone can be half an object."""
    meta = body.get("metadata") or {}
    out: dict[str, Any] = {
        "kind": body.get("kind"),
        "metadata": {
            k: meta[k]
            for k in (
                "name",
                "namespace",
                "uid",
                "resourceVersion",
                "generation",
                "labels",
                "annotations",
                "ownerReferences",
                "deletionTimestamp",
            )
            if k in meta
        },
    }
    for section in ("spec", "data", "status"):
        if section in body:
            out[section] = body[section]
    return out


for _group, _version, _plural, _kind in CHILD_KINDS:
    kopf.index(_group, _version, _plural, labels=MANAGED, id=f"children_{_plural}")(_child_index(_kind))


def _child_entries(kwargs: dict[str, Any], key: tuple[str, str]) -> list[Any]:
    """The index entries of one owner's children. Call on the loop thread (``memo.read``)."""
    out: list[Any] = []
    for _g, _v, plural, _k in CHILD_KINDS:
        out.extend(kwargs[f"children_{plural}"].get(key, ()))
    return out


def _children_reader(memo: Any, kwargs: dict[str, Any], key: tuple[str, str]) -> Callable[[], Children]:
    """A snapshot function of one owner's live children for the reconciler (read on the loop)."""
    indexes = {f"children_{p}": kwargs[f"children_{p}"] for _g, _v, p, _k in CHILD_KINDS}

    def snapshot() -> Children:
        entries = memo.read(lambda: _child_entries(indexes, key))
        return {(e["kind"], e["name"]): unpack(e["body"]) for e in entries}

    return snapshot


def _owner_from_index(memo: Any, owners: kopf.Index, key: tuple[str, str]) -> Owner | None:
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
    **kwargs: Any,
) -> None:
    """Make the children match the spec; report what was done in status."""
    owner = Owner(
        namespace=namespace,
        name=name,
        uid=str(meta["uid"]),
        generation=meta.get("generation"),
        spec=dict(body.get("spec") or {}),
        status={k: v for k, v in (body.get("status") or {}).items() if k != "kopf"},
    )
    out = memo.reconciler.reconcile(owner, _children_reader(memo, kwargs, owner.key))
    if out.apply_error:
        raise kopf.TemporaryError(out.apply_error, delay=10)


# ----------------------------------------------------------------------------------- children
def _child_event(kind: str):  # type: ignore[no-untyped-def]
    async def handler(
        event: dict[str, Any],
        namespace: str,
        name: str,
        body: kopf.Body,
        labels: kopf.Labels,
        owners: kopf.Index,
        memo: kopf.Memo,
        **kwargs: Any,
    ) -> None:
        """Runs on the event loop: most child events (the echoes of our own applies during a burst)
        are dismissed here in microseconds; only a repair or a status refresh goes to a thread."""
        owner_name = labels.get(OWNER_LABEL)
        if not owner_name:
            return
        key = (namespace, owner_name)
        rec: Reconciler = memo.reconciler
        deleted = event.get("type") == "DELETED"
        if not deleted and rec.seen(key, kind, name, (body.get("metadata") or {}).get("resourceVersion")):
            return
        owner = _owner_from_index(memo, owners, key)
        if owner is None or owner.deleting:
            return
        live = None if deleted else dict(body)
        if rec.applied_generation(key) != owner.generation and not rec.child_drifted(owner, kind, name, live):
            return  # the owner handler is applying this generation and will write status itself
        await asyncio.to_thread(
            rec.refresh, owner, _children_reader(memo, kwargs, key), repair=(kind, name, live)
        )

    return handler


for _group, _version, _plural, _kind in CHILD_KINDS:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"repair_{_plural}")(_child_event(_kind))


@kopf.on.event(GROUP, VERSION, PLURAL)
def forget_deleted(event: dict[str, Any], namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Drop per-owner memory once an EPDDeployment is gone, so long-running operators stay small."""
    if event.get("type") == "DELETED":
        memo.reconciler.forget((namespace, name))


def _not_ready(status: kopf.Status, **_: Any) -> bool:
    return (status or {}).get("phase") not in ("Ready", "Failed", None)


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    id="capacity",
    interval=CAPACITY_CHECK_S,
    initial_delay=CAPACITY_CHECK_S,
    idle=None,
    when=_not_ready,
)
def capacity_check(namespace: str, name: str, owners: kopf.Index, memo: kopf.Memo, **kwargs: Any) -> None:
    """While an owner is not Ready, look for its pods the scheduler cannot place.

    Unschedulable pods change no Deployment status, so nothing else would tell us. Asking the API
    server for the owner's *unbound* pods (a field selector) every few seconds, only while it is
    not Ready, is far cheaper than watching every pod of every deployment (kopf keeps per-object
    state for each watched pod: 1000 pods cost ~140 MB in our scale benchmark).
    """
    key = (namespace, name)
    memo.reconciler.check_capacity(_owner_from_index(memo, owners, key), _children_reader(memo, kwargs, key))


# ----------------------------------------------------------------------------------- admission
def validate(spec: kopf.Spec, name: str | None = None, **_: Any) -> None:
    """Refuse an invalid spec (or a name whose labels cannot be applied) at ``kubectl apply`` time,
    naming each offending field."""
    errors = name_errors(name or "")
    try:
        parse_spec(dict(spec))
    except ValidationError as exc:
        errors += spec_errors(exc)
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


# ----------------------------------------------------------------------------------- settings
@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Runs on the event loop: builds the reconciler (unless injected) and the loop reader."""
    if "reconciler" not in memo:
        memo.reconciler = Reconciler(client_factory=Kube)
    memo.read = LoopReader(asyncio.get_running_loop())
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
