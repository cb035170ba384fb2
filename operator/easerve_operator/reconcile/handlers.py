"""kopf handlers: the reconcile loop of the EPDDeployment operator.

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

kopf keeps its own bookkeeping in ``status.kopf`` rather than in annotations, so the objects a
GitOps tool compares against Git carry no operator-written metadata.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import kopf
from easerve_runtime.api import (
    FINALIZER,
    GROUP,
    LABEL_DEPLOYMENT,
    LABEL_STAGE,
    PLURAL,
    VERSION,
    EPDDeploymentSpec,
    parse_spec,
    spec_errors,
)
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from easerve_operator.reconcile import metrics
from easerve_operator.reconcile.defaults import OperatorDefaults, with_operator_defaults
from easerve_operator.reconcile.drift import drifted
from easerve_operator.reconcile.kube import Kube
from easerve_operator.reconcile.status import StageObservation, compute_status, status_differs
from easerve_operator.render import render_children

MANAGED = {"app.kubernetes.io/managed-by": "easerve-operator"}
OWNER_LABEL = LABEL_DEPLOYMENT
STAGE_LABEL = LABEL_STAGE
CHILD_KINDS = (
    ("", "v1", "configmaps", "ConfigMap"),
    ("", "v1", "services", "Service"),
    ("apps", "v1", "deployments", "Deployment"),
)


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
    defaults: OperatorDefaults = field(default_factory=OperatorDefaults)  # filled into specs before render


OPTIONS = Options()
_kube: Kube | None = None
_kube_lock = threading.Lock()
# Status is written from two paths (the owner handler and child events). Per owner, writes are
# serialised and always computed from the newest observation, so the last write wins *and* is
# the freshest; a generation's status is only written once its children were applied.
_owner_locks: dict[tuple[str, str], threading.Lock] = collections.defaultdict(threading.Lock)
_applied: dict[tuple[str, str], int | None] = {}
_unschedulable: dict[tuple[str, str], list[str]] = {}  # owner -> "pod: scheduler message"
CAPACITY_CHECK_S = 5.0
_last_status: dict[tuple[str, str], bytes] = {}  # packed: compared and read back rarely


def kube() -> Kube:
    global _kube
    with _kube_lock:
        if _kube is None:
            _kube = Kube()
        return _kube


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------- indexes
@kopf.index(GROUP, VERSION, PLURAL)
def owners(namespace: str, name: str, body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {
        (namespace, name): {
            "uid": meta.get("uid"),
            "generation": meta.get("generation"),
            "deleting": bool(meta.get("deletionTimestamp")),
            "spec": _pack(dict(body.get("spec") or {})),
            "status": _pack({k: v for k, v in (body.get("status") or {}).items() if k != "kopf"}),
        }
    }


def _child_index(kind: str):  # type: ignore[no-untyped-def]
    def index(namespace: str, name: str, body: kopf.Body, labels: kopf.Labels, **_: Any) -> dict[Any, Any]:
        owner = labels.get(OWNER_LABEL)
        if not owner:
            return {}
        return {(namespace, owner): {"kind": kind, "name": name, "body": _pack(_trim(body))}}

    return index


def _pack(body: dict[str, Any]) -> bytes:
    """Children are kept as compressed JSON: a tenth of the memory of live dicts, and decoded
    (tens of microseconds) only when their owner is looked at."""
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 1)


def _unpack(blob: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(blob))  # type: ignore[no-any-return]


def _last(key: tuple[str, str]) -> dict[str, Any] | None:
    blob = _last_status.get(key)
    return None if blob is None else _unpack(blob)


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


def _one(index: kopf.Index, key: Any) -> Any:
    store = index.get(key)
    return next(iter(store), None) if store is not None else None


def _children(indexes: dict[str, kopf.Index], key: tuple[str, str]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for _g, _v, plural, _k in CHILD_KINDS:
        for entry in indexes[f"children_{plural}"].get(key, []):
            out[(entry["kind"], entry["name"])] = _unpack(entry["body"])
    return out


def _indexes(kwargs: dict[str, Any]) -> dict[str, kopf.Index]:
    return {f"children_{p}": kwargs[f"children_{p}"] for _g, _v, p, _k in CHILD_KINDS}


# ----------------------------------------------------------------------------------- status
def _observe(
    desired: list[dict[str, Any]], live: dict[tuple[str, str], dict[str, Any]]
) -> dict[str, StageObservation]:
    obs: dict[str, StageObservation] = {}
    for obj in desired:
        if obj["kind"] != "Deployment":
            continue
        stage = obj["metadata"]["labels"][STAGE_LABEL]
        body = live.get(("Deployment", obj["metadata"]["name"]))
        obs[stage] = StageObservation.from_deployment(body, int(obj["spec"]["replicas"]))
        if body is not None and drifted(body, obj):
            obs[stage] = StageObservation(
                desired=obs[stage].desired, ready=obs[stage].ready
            )  # not yet rolled
    return obs


def _write_status(namespace: str, name: str, current: dict[str, Any] | None, status: dict[str, Any]) -> None:
    """Write status unless it says nothing new. Call with the owner's lock held."""
    key = (namespace, name)
    if not status_differs(_last(key) or current, status):
        return
    kube().patch_status(namespace, name, status)
    _last_status[key] = _pack(status)
    metrics.STATUS_WRITES.inc()


def _newest(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The later of two observations of one object (resourceVersions are etcd revisions)."""
    if a is None or b is None:
        return a or b
    try:
        ra, rb = int(a["metadata"]["resourceVersion"]), int(b["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return b
    return a if ra >= rb else b


_RENDER_CACHE_SIZE = 64
_RENDER_CACHE: dict[
    tuple[str, str, str, int | None], tuple[EPDDeploymentSpec | None, list[str], list[dict[str, Any]]]
] = {}


def _desired(
    namespace: str, name: str, uid: str, generation: int | None, raw_spec: dict[str, Any]
) -> tuple[EPDDeploymentSpec | None, list[str], list[dict[str, Any]]]:
    """Parse and render once per (owner, generation): child and pod events arrive by the thousand."""
    key = (namespace, name, uid, generation)
    hit = _RENDER_CACHE.get(key)
    if hit is None:
        spec, errors = _parse(raw_spec)
        if spec is not None:
            spec = with_operator_defaults(spec, OPTIONS.defaults)
        desired = render_children(name, namespace, uid, spec) if spec is not None else []
        if len(_RENDER_CACHE) >= _RENDER_CACHE_SIZE:  # small: rendering costs ~0.3 ms, memory is dearer
            _RENDER_CACHE.pop(next(iter(_RENDER_CACHE)))
        hit = _RENDER_CACHE[key] = (spec, errors, desired)
    return hit


def _parse(spec: dict[str, Any]) -> tuple[EPDDeploymentSpec | None, list[str]]:
    try:
        return parse_spec(spec), []
    except ValidationError as exc:
        return None, spec_errors(exc)


# ----------------------------------------------------------------------------------- owner
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(
    namespace: str,
    name: str,
    body: kopf.Body,
    meta: kopf.Meta,
    logger: logging.Logger,
    **kwargs: Any,
) -> None:
    """Make the children match the spec; report what was done in status."""
    generation = meta.get("generation")
    key = (namespace, name)
    current = {k: v for k, v in (body.get("status") or {}).items() if k != "kopf"}
    spec, errors, desired = _desired(
        namespace, name, str(meta["uid"]), generation, dict(body.get("spec") or {})
    )
    if spec is None:
        metrics.RECONCILES.labels(result="invalid").inc()
        logger.warning("invalid spec, nothing created: %s", "; ".join(errors))
        with _owner_locks[key]:
            _applied[key] = generation
            prev = (_last(key) or current).get("conditions")
            st = compute_status(
                generation=generation,
                spec=None,
                errors=errors,
                stages={},
                previous_conditions=prev,
                now=_now(),
            )
            _write_status(namespace, name, current, st)
        return
    live = _children(_indexes(kwargs), key)
    apply_error = None
    for obj in desired:
        child = (obj["kind"], obj["metadata"]["name"])
        if not drifted(live.get(child), obj):
            continue
        try:
            live[child] = kube().apply(obj)
            metrics.CHILD_WRITES.labels(kind=obj["kind"]).inc()
        except ApiException as exc:
            apply_error = f"{obj['kind']} {obj['metadata']['name']}: {exc.reason} ({exc.status})"
            logger.error("apply failed: %s", apply_error)
    _prune(namespace, desired, live, logger)
    with _owner_locks[key]:
        _applied[key] = generation
        fresh = _children(_indexes(kwargs), key)  # events may have moved on while we applied
        for k in set(live) | set(fresh):
            newest = _newest(live.get(k), fresh.get(k))
            if newest is not None:
                live[k] = newest
        pending = list(_unschedulable.get(key, []))
        prev = (_last(key) or current).get("conditions")
        st = compute_status(
            generation=generation,
            spec=spec,
            errors=[],
            stages=_observe(desired, live),
            unschedulable=pending,
            apply_error=apply_error,
            previous_conditions=prev,
            now=_now(),
        )
        _write_status(namespace, name, current, st)
    metrics.RECONCILES.labels(result="error" if apply_error else "ok").inc()
    if apply_error:
        raise kopf.TemporaryError(apply_error, delay=10)


def _prune(
    namespace: str,
    desired: list[dict[str, Any]],
    live: dict[tuple[str, str], dict[str, Any]],
    logger: logging.Logger,
) -> None:
    """Delete children we no longer render (e.g. after a mode switch); owner refs cover the rest."""
    want = {(o["kind"], o["metadata"]["name"]) for o in desired}
    for kind, cname in [k for k in live if k not in want]:
        logger.info("deleting stale %s %s", kind, cname)
        try:
            kube().delete(kind, namespace, cname)
        except ApiException as exc:
            if exc.status != 404:
                raise
        live.pop((kind, cname), None)


# ----------------------------------------------------------------------------------- children
def _refresh(
    namespace: str,
    owner_name: str,
    owners: kopf.Index,
    kwargs: dict[str, Any],
    repair: tuple[str, dict[str, Any] | None, str] | None = None,
) -> None:
    """Repair one child if needed, then recompute the owner's status from the indexes."""
    owner = _one(owners, (namespace, owner_name))
    if owner is None or owner["deleting"]:
        return
    spec, errors, desired = _desired(
        namespace, owner_name, str(owner["uid"]), owner["generation"], _unpack(owner["spec"])
    )
    if spec is None:
        return  # the owner handler reports InvalidSpec; children of an invalid spec are left alone
    repaired: dict[tuple[str, str], dict[str, Any]] = {}
    if repair is not None:
        kind, body, cname = repair
        want = next((o for o in desired if o["kind"] == kind and o["metadata"]["name"] == cname), None)
        if want is not None and drifted(body, want):
            repaired[(kind, cname)] = kube().apply(want)
            metrics.CHILD_WRITES.labels(kind=kind).inc()
            metrics.REPAIRS.labels(kind=kind).inc()
    key = (namespace, owner_name)
    with _owner_locks[key]:
        if _applied.get(key) != owner["generation"]:
            return  # the owner handler has not applied this generation yet; it writes status itself
        live = _children(_indexes(kwargs), key)
        for k, v in repaired.items():
            live[k] = _newest(live.get(k), v) or v
        current = _unpack(owner["status"])
        pending = list(_unschedulable.get(key, []))
        prev = (_last(key) or current).get("conditions")
        st = compute_status(
            generation=owner["generation"],
            spec=spec,
            errors=errors,
            stages=_observe(desired, live),
            unschedulable=pending,
            previous_conditions=prev,
            now=_now(),
        )
        _write_status(namespace, owner_name, current, st)


def _child_event(kind: str):  # type: ignore[no-untyped-def]
    def handler(
        event: dict[str, Any],
        namespace: str,
        name: str,
        body: kopf.Body,
        labels: kopf.Labels,
        owners: kopf.Index,
        **kwargs: Any,
    ) -> None:
        owner = labels.get(OWNER_LABEL)
        if not owner:
            return
        live = None if event.get("type") == "DELETED" else dict(body)
        _refresh(namespace, owner, owners, kwargs, repair=(kind, live, name))

    return handler


for _group, _version, _plural, _kind in CHILD_KINDS:
    kopf.on.event(_group, _version, _plural, labels=MANAGED, id=f"repair_{_plural}")(_child_event(_kind))


@kopf.on.event(GROUP, VERSION, PLURAL)
def forget_deleted(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
    """Drop per-owner memory once an EPDDeployment is gone, so long-running operators stay small."""
    if event.get("type") == "DELETED":
        key = (namespace, name)
        _applied.pop(key, None)
        _last_status.pop(key, None)
        _owner_locks.pop(key, None)
        _unschedulable.pop(key, None)


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
def capacity_check(namespace: str, name: str, owners: kopf.Index, **kwargs: Any) -> None:
    """While an owner is not Ready, look for its pods the scheduler cannot place.

    Unschedulable pods change no Deployment status, so nothing else would tell us. Asking the API
    server for the owner's *unbound* pods (a field selector) every few seconds, only while it is
    not Ready, is far cheaper than watching every pod of every deployment (kopf keeps per-object
    state for each watched pod: 1000 pods cost ~140 MB in our scale benchmark).
    """
    key = (namespace, name)
    found = kube().unschedulable_pods(namespace, f"{OWNER_LABEL}={name}")
    if found != _unschedulable.get(key, []):
        _unschedulable[key] = found
        _refresh(namespace, name, owners, kwargs)


# ----------------------------------------------------------------------------------- admission
def validate(spec: kopf.Spec, **_: Any) -> None:
    """Refuse an invalid spec at ``kubectl apply`` time, naming each offending field."""
    _, errors = _parse(dict(spec))
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
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
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
