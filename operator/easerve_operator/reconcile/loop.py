"""The reconcile loop as an object: it owns its caches and locks, and talks to a small client.

``Reconciler`` holds everything the loop remembers between events (per-owner locks, the
generation whose children were applied, the last status written, unschedulable pods, a render
cache) and reaches the cluster only through ``Client`` (apply, delete, patch status, list
unbound pods). kopf's handlers (``handlers.py``) are a thin shell: they turn kopf's arguments
into an ``Owner`` and a ``children`` snapshot function and call one method here. So the loop is
unit-tested against an in-memory fake client (tests/operator/test_loop.py), beside the tests
against a real API server.

WHY ``children`` is a function and not a dict: the loop reads the live children twice, before
applying and again under the owner's lock right before computing status (events may have moved
on while it applied); the handler decides how to read kopf's indexes safely from this thread.

Decisions made here, each tested:

* **apply-if-drifted**: a child is applied only when missing, or when a field we render was
  changed or removed (``drift.drifted``); an unchanged resume writes nothing;
* **prune**: children we no longer render (e.g. after a mode switch) are deleted;
* **repair**: a child event for a drifted or deleted child re-applies it from the owner's spec;
* **write-only-if-changed**: status is written only when it says something new, and per owner
  writes are serialised and computed from the newest observation (by ``resourceVersion``), so
  the last write wins *and* is the freshest; a generation's status is only written by child
  events once the owner handler applied that generation.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from easerve_runtime.api import (
    ANNOTATION_CONFIG_HASH,
    LABEL_STAGE,
    EPDDeploymentSpec,
    SpecError,
    name_errors,
    parse_spec,
    spec_errors,
)
from easerve_runtime.api.status import EffectiveConfig
from easerve_runtime.profiles import profile_errors
from easerve_runtime.topology import plan
from pydantic import ValidationError

from easerve_operator.reconcile import metrics
from easerve_operator.reconcile.drift import drifted
from easerve_operator.reconcile.effective import resolve
from easerve_operator.reconcile.status import StageObservation, compute_status, status_differs
from easerve_operator.render import render_children

Key = tuple[str, str]  # (namespace, name) of an owner
ChildKey = tuple[str, str]  # (kind, name) of a child
Children = dict[ChildKey, dict[str, Any]]
log = logging.getLogger(__name__)


class ClientError(Exception):
    """The API server refused a request (``status`` is the HTTP status)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{reason} ({status})")
        self.status, self.reason = status, reason


class Client(Protocol):
    """What the loop needs of the Kubernetes API (``kube.Kube`` is the real one)."""

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply one child; return the live object."""
        ...

    def delete(self, kind: str, namespace: str, name: str) -> None: ...

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None: ...

    def unschedulable_pods(self, namespaces: list[str] | None) -> dict[Key, list[str]]:
        """Per owner, its unbound pods the scheduler marked Unschedulable ("pod: message")."""
        ...


@dataclass(frozen=True)
class Owner:
    """One EPDDeployment as the loop sees it."""

    namespace: str
    name: str
    uid: str
    generation: int | None
    spec: dict[str, Any]
    status: dict[str, Any] = field(default_factory=dict)  # without status.kopf
    deleting: bool = False

    @property
    def key(self) -> Key:
        return (self.namespace, self.name)


@dataclass(frozen=True)
class Desired:
    spec: EPDDeploymentSpec | None
    """What runs: the stored spec with tuned values on its unset searched fields (``effective``)."""
    errors: list[str]
    children: list[dict[str, Any]]
    effective: EffectiveConfig | None = None
    waiting: str | None = None
    """Why nothing is deployed yet (the first HAS search chooses unset values), else None."""
    overlay: str = "-"
    """Which tuned values were laid over the spec (``Resolved.key``)."""


@dataclass(frozen=True)
class Outcome:
    """What one owner reconcile did (``apply_error``: the handler asks kopf to retry)."""

    applied: int = 0
    pruned: int = 0
    status_written: bool = False
    apply_error: str | None = None
    invalid: bool = False


def pack(body: dict[str, Any]) -> bytes:
    """Compressed JSON: a tenth of the memory of live dicts, decoded only when looked at."""
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 1)


def unpack(blob: bytes) -> dict[str, Any]:
    return json.loads(zlib.decompress(blob))


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def newest(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """The later of two observations of one object (resourceVersions are etcd revisions)."""
    if a is None or b is None:
        return a or b
    try:
        ra, rb = int(a["metadata"]["resourceVersion"]), int(b["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return b
    return a if ra >= rb else b


def observe(desired: list[dict[str, Any]], live: Children) -> dict[str, StageObservation]:
    """Per rendered Deployment (one per stage): what its live object says."""
    obs: dict[str, StageObservation] = {}
    for obj in desired:
        if obj["kind"] != "Deployment":
            continue
        stage = obj["metadata"]["labels"][LABEL_STAGE]
        body = live.get(("Deployment", obj["metadata"]["name"]))
        o = StageObservation.from_deployment(body, int(obj["spec"]["replicas"]))
        if body is not None and drifted(body, obj):
            o = StageObservation(desired=o.desired, ready=o.ready)  # not yet rolled
        obs[stage] = o
    return obs


def config_hash(live: Children) -> str | None:
    """The checksum of the runtime ConfigMap in force (the live one's annotation)."""
    for (kind, _), body in live.items():
        if kind == "ConfigMap":
            value = ((body.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_CONFIG_HASH)
            return None if value is None else str(value)
    return None


def _bounded_put(cache: dict[Any, Any], key: Any, value: Any, size: int) -> None:
    if len(cache) >= size:
        cache.pop(next(iter(cache)))
    cache[key] = value


def check_spec(raw: dict[str, Any]) -> tuple[EPDDeploymentSpec | None, list[str]]:
    """Every rule a spec must pass before anything is created, shared by the webhook and the
    reconciler: the models' rules, the spec against its latency profile where readable here
    (``spec.model.encoder``), and the layout rules of the topology (local prefill TP)."""
    try:
        spec = parse_spec(raw)
    except ValidationError as exc:
        return None, spec_errors(exc)
    errs = [str(e) for e in profile_errors(spec)]
    if errs:
        return None, errs
    try:
        plan(spec)
    except SpecError as exc:
        return None, [str(exc)]
    return spec, []


class Reconciler:
    """The loop's state and decisions; one instance per operator process (see module docstring).

    Thread-safe: kopf runs sync handlers on a thread pool, several at once. ``_lock`` guards the
    maps; the per-owner lock serialises an owner's status computation and write.
    """

    RENDER_CACHE_SIZE = 64  # small: rendering costs ~0.3 ms, memory is dearer

    def __init__(
        self,
        client: Client | None = None,
        *,
        client_factory: Callable[[], Client] | None = None,
        now: Callable[[], str] = now_utc,
        render: Callable[[str, str, str, EPDDeploymentSpec], list[dict[str, Any]]] = render_children,
    ) -> None:
        if (client is None) == (client_factory is None):
            raise ValueError("give exactly one of client and client_factory")
        self._factory = client_factory
        self._client: Client | None = client
        self.now = now
        self.render = render
        self._lock = threading.Lock()
        self._owner_locks: dict[Key, threading.Lock] = {}
        self._applied: dict[Key, int | None] = {}
        self._unschedulable: dict[Key, list[str]] = {}
        self._last_status: dict[Key, bytes] = {}  # packed: compared and read back rarely
        self._parsed: dict[tuple[str, str, str, int | None], tuple[EPDDeploymentSpec | None, list[str]]] = {}
        self._render_cache: dict[tuple[str, str, str, int | None, str], Desired] = {}
        self._overlay: dict[Key, str] = {}  # per owner: the tuned overlay its children were applied with
        # per owner: the resourceVersion of each child that was checked for drift and is in the
        # status already; an event for exactly that version (our own apply's echo) is a no-op
        self._seen: dict[Key, dict[ChildKey, str]] = {}
        # owners whose status the owner handler handed to kopf's own patch (not yet seen landed),
        # and whether a child event wanted to write meanwhile (it writes once the patch landed)
        self._deferred: dict[Key, int | None] = {}
        self._dirty: set[Key] = set()

    # ------------------------------------------------------------------------------ plumbing
    @property
    def client(self) -> Client:
        """Built on first use (the real one reads a kubeconfig), then shared."""
        with self._lock:
            if self._client is None:
                assert self._factory is not None
                self._client = self._factory()
            return self._client

    def owner_lock(self, key: Key) -> threading.Lock:
        with self._lock:
            lock = self._owner_locks.get(key)
            if lock is None:
                lock = self._owner_locks[key] = threading.Lock()
            return lock

    def last_status(self, key: Key) -> dict[str, Any] | None:
        blob = self._last_status.get(key)
        return None if blob is None else unpack(blob)

    def unschedulable(self, key: Key) -> list[str]:
        with self._lock:
            return list(self._unschedulable.get(key, []))

    def applied_generation(self, key: Key) -> int | None:
        return self._applied.get(key)

    def forget(self, key: Key) -> None:
        """Drop per-owner memory once an EPDDeployment is gone, so long-running operators stay small."""
        with self._lock:
            self._applied.pop(key, None)
            self._last_status.pop(key, None)
            self._owner_locks.pop(key, None)
            self._unschedulable.pop(key, None)
            self._seen.pop(key, None)
            self._deferred.pop(key, None)
            self._dirty.discard(key)
            self._overlay.pop(key, None)

    def landed(self, key: Key, observed_generation: int | None) -> bool:
        """An owner event: if it shows the status handed to kopf's patch, stop deferring. Returns
        whether a child event wanted to write meanwhile (then refresh now)."""
        with self._lock:
            if key not in self._deferred or self._deferred[key] != observed_generation:
                return False
            del self._deferred[key]
            if key in self._dirty:
                self._dirty.discard(key)
                return True
            return False

    def seen(self, key: Key, kind: str, name: str, resource_version: str | None) -> bool:
        """Whether this exact version of a child was drift-checked and reported already, so an event
        for it (the echo of our own apply, mostly) needs no work. Safe to call from the loop thread."""
        return resource_version is not None and self._seen.get(key, {}).get((kind, name)) == str(resource_version)

    def _mark_seen(self, key: Key, children: Children) -> None:
        with self._lock:
            seen = self._seen.setdefault(key, {})
            for ck, body in children.items():
                rv = (body.get("metadata") or {}).get("resourceVersion")
                if rv is not None:
                    seen[ck] = str(rv)

    def child_drifted(self, owner: Owner, kind: str, name: str, body: dict[str, Any] | None) -> bool:
        """Whether a child event asks for a repair (the child is ours, and missing or drifted)."""
        want = self.desired(owner)
        target = next((o for o in want.children if o["kind"] == kind and o["metadata"]["name"] == name), None)
        return target is not None and drifted(body, target)

    def desired(self, owner: Owner) -> Desired:
        """Parse once per (owner, generation), lay the tuned values over it (``effective.resolve``:
        cheap, but it changes when a search ends, with no new generation), render once per
        (generation, overlay): child events arrive by the thousand."""
        gen_key = (owner.namespace, owner.name, owner.uid, owner.generation)
        with self._lock:
            parsed = self._parsed.get(gen_key)
        if parsed is None:
            errors = name_errors(owner.name)
            spec: EPDDeploymentSpec | None = None
            if not errors:
                spec, errors = check_spec(owner.spec)
            parsed = (spec, errors)
            with self._lock:
                _bounded_put(self._parsed, gen_key, parsed, self.RENDER_CACHE_SIZE)
        spec, errors = parsed
        if spec is None:
            return Desired(None, errors, [])
        r = resolve(owner.spec, spec, owner.status.get("tuning"), owner.status.get("effective"), owner.status.get("adapt"))
        key = (*gen_key, r.key)
        with self._lock:
            hit = self._render_cache.get(key)
        if hit is not None:
            return hit
        if r.spec is None:
            hit = Desired(None, r.errors, [], overlay=r.key)
        elif r.waiting is not None:
            hit = Desired(r.spec, [], [], waiting=r.waiting, overlay=r.key)
        else:
            children = self.render(owner.name, owner.namespace, owner.uid, r.spec)
            hit = Desired(r.spec, [], children, effective=r.effective(), overlay=r.key)
        with self._lock:
            _bounded_put(self._render_cache, key, hit, self.RENDER_CACHE_SIZE)
        return hit

    def overlay_changed(self, owner: Owner) -> bool:
        """Whether the tuned values to run differ from those the children were applied with (a
        search just ended): status.tuning changes bring no new generation, so kopf's spec
        handler would never run again for it."""
        if self._applied.get(owner.key) != owner.generation:
            return False  # the owner handler has this generation in hand
        want = self.desired(owner)
        return self._overlay.get(owner.key, want.overlay) != want.overlay

    def _write_status(
        self, owner: Owner, status: dict[str, Any], via: Callable[[dict[str, Any]], None] | None = None
    ) -> bool:
        """Write status unless it says nothing new. Call with the owner's lock held.

        ``via``: hand the status to the caller's own patch instead (kopf's, which it sends after
        the handler anyway): one write instead of two, and no event of a half-handled object
        (which made kopf run the create handler a second time). Until that patch is seen landed
        (``landed``), other writers only note that they have something newer."""
        with self._lock:
            if owner.key in self._deferred and via is None:
                self._dirty.add(owner.key)
                return False
        if not status_differs(self.last_status(owner.key) or owner.status, status):
            return False
        if via is not None:
            via(status)
            with self._lock:
                self._deferred[owner.key] = owner.generation
        else:
            self.client.patch_status(owner.namespace, owner.name, status)
        self._last_status[owner.key] = pack(status)
        metrics.STATUS_WRITES.inc()
        return True

    def _status(
        self,
        owner: Owner,
        want: Desired,
        live: Children,
        apply_error: str | None = None,
    ) -> dict[str, Any]:
        prev = (self.last_status(owner.key) or owner.status).get("conditions")
        return compute_status(
            generation=owner.generation,
            spec=want.spec,
            errors=want.errors,
            stages=observe(want.children, live),
            unschedulable=self.unschedulable(owner.key),
            apply_error=apply_error,
            previous_conditions=prev,
            config_hash=config_hash(live),
            now=self.now(),
            effective_config=want.effective,
            tuning_wait=want.waiting,
        ).wire()

    # ------------------------------------------------------------------------------ owner
    def reconcile(
        self,
        owner: Owner,
        children: Callable[[], Children],
        status_via: Callable[[dict[str, Any]], None] | None = None,
    ) -> Outcome:
        """Make the children match the spec (apply-if-drifted, prune); report in status (through
        ``status_via`` when given: see ``_write_status``)."""
        with metrics.RECONCILE_SECONDS.time():
            return self._reconcile(owner, children, status_via)

    def _reconcile(
        self,
        owner: Owner,
        children: Callable[[], Children],
        status_via: Callable[[dict[str, Any]], None] | None,
    ) -> Outcome:
        want = self.desired(owner)
        with self._lock:
            self._overlay[owner.key] = want.overlay
        if want.spec is None:
            metrics.RECONCILES.labels(result="invalid").inc()
            log.warning("%s/%s: invalid, nothing created: %s", *owner.key, "; ".join(want.errors))
            with self.owner_lock(owner.key):
                self._applied[owner.key] = owner.generation
                wrote = self._write_status(owner, self._status(owner, want, {}), status_via)
            return Outcome(status_written=wrote, invalid=True)
        live = children()
        apply_error = None
        applied = 0
        for obj in want.children:
            child = (obj["kind"], obj["metadata"]["name"])
            if not drifted(live.get(child), obj):
                continue
            try:
                live[child] = self.client.apply(obj)
                applied += 1
                metrics.CHILD_WRITES.labels(kind=obj["kind"]).inc()
            except ClientError as exc:
                apply_error = f"{obj['kind']} {obj['metadata']['name']}: {exc.reason} ({exc.status})"
                log.error("%s/%s: apply failed: %s", *owner.key, apply_error)
        pruned = self._prune(owner, want.children, live)
        self._mark_seen(owner.key, live)  # each was drift-checked or is our apply's answer
        with self.owner_lock(owner.key):
            self._applied[owner.key] = owner.generation
            fresh = children()  # events may have moved on while we applied
            for k in set(live) | set(fresh):
                n = newest(live.get(k), fresh.get(k))
                if n is not None:
                    live[k] = n
            wrote = self._write_status(owner, self._status(owner, want, live, apply_error), status_via)
        metrics.RECONCILES.labels(result="error" if apply_error else "ok").inc()
        return Outcome(applied, pruned, wrote, apply_error)

    def _prune(self, owner: Owner, desired: list[dict[str, Any]], live: Children) -> int:
        """Delete children we no longer render (e.g. after a mode switch); owner refs cover the rest."""
        want = {(o["kind"], o["metadata"]["name"]) for o in desired}
        stale = [k for k in live if k not in want]
        for kind, cname in stale:
            log.info("%s/%s: deleting stale %s %s", *owner.key, kind, cname)
            try:
                self.client.delete(kind, owner.namespace, cname)
            except ClientError as exc:
                if exc.status != 404:
                    raise
            live.pop((kind, cname), None)
        return len(stale)

    # ------------------------------------------------------------------------------ children
    def refresh(
        self,
        owner: Owner | None,
        children: Callable[[], Children],
        repair: tuple[str, str, dict[str, Any] | None] | None = None,
    ) -> bool:
        """A child changed (``repair`` = its kind, name and body, None when deleted): re-apply it if
        it drifted, then recompute the owner's status. Returns whether status was written."""
        if owner is None or owner.deleting:
            return False
        want = self.desired(owner)
        if want.spec is None:
            return False  # the owner handler reports InvalidSpec; children of an invalid spec are left alone
        repaired: Children = {}
        if repair is not None:
            kind, cname, body = repair
            target = next((o for o in want.children if o["kind"] == kind and o["metadata"]["name"] == cname), None)
            if target is not None and drifted(body, target):
                repaired[(kind, cname)] = self.client.apply(target)
                metrics.CHILD_WRITES.labels(kind=kind).inc()
                metrics.REPAIRS.labels(kind=kind).inc()
        with self.owner_lock(owner.key):
            if self._applied.get(owner.key) != owner.generation:
                return False  # the owner handler has not applied this generation yet; it writes status itself
            live = children()
            for k, v in repaired.items():
                live[k] = newest(live.get(k), v) or v
            wrote = self._write_status(owner, self._status(owner, want, live))
            if repair is not None and repair[2] is not None and not repaired:
                self._mark_seen(owner.key, {(repair[0], repair[1]): repair[2]})  # checked, and reported
            return wrote

    def capacity_sweep(
        self,
        namespaces: list[str] | None,
        owner: Callable[[Key], Owner | None],
        children: Callable[[Key], Callable[[], Children]],
    ) -> list[Key]:
        """Look for pods the scheduler cannot place, for every owner at once; refresh the status of
        the owners whose set changed. Returns those owners.

        Unschedulable pods change no Deployment status, so nothing else would tell us. One list of
        *unbound* pods (a field selector) per sweep is far cheaper than a timer per owner (200
        owners: 40 list calls a second) or a watch on every pod (kopf per-object state for each).
        """
        found = self.client.unschedulable_pods(namespaces)
        with self._lock:
            changed = [k for k in set(found) | set(self._unschedulable) if found.get(k, []) != self._unschedulable.get(k, [])]
            for k in changed:
                if found.get(k):
                    self._unschedulable[k] = found[k]
                else:
                    self._unschedulable.pop(k, None)
        for k in changed:
            self.refresh(owner(k), children(k))
        return changed
