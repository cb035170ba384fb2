"""The children's informer over in-memory list/watch sources (the real ones are exercised in
test_operator_k8s.py): it waits for the first list, drops echoes, reports changes and deletions,
and re-lists after an expired watch."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from easerve_operator.reconcile.informer import KINDS, ChildInformer

LABEL = "easerve.io/deployment"


def obj(name: str, rv: int, owner: str | None = "app", ns: str = "team", **extra: Any) -> dict[str, Any]:
    labels = {LABEL: owner} if owner else {}
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": str(rv), "labels": labels,
                         "managedFields": [{"big": "x" * 100}]}, **extra}


class Source:
    """One kind's API: a list, then a watch fed from a queue (None ends the watch)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.lists = 0
        self.listed = threading.Event()

    def list(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        self.listed.set()
        return list(self.items), "10"

    def watch(self, rv: str) -> Iterator[dict[str, Any]]:
        while True:
            ev = self.events.get()
            if ev is None:
                return
            yield ev


def make(sources: dict[str, Source], known: set[tuple[str, str, str]] | None = None) -> tuple[ChildInformer, queue.Queue]:
    changes: queue.Queue[tuple[Any, ...]] = queue.Queue()
    known = known or set()
    inf = ChildInformer(
        {k: [(None, (s.list, s.watch))] for k, s in sources.items()},
        LABEL,
        on_change=lambda *a: changes.put(a),
        is_known=lambda key, kind, name, rv: (kind, name, str(rv)) in known,
        dispatchers=1,
    )
    return inf, changes


def test_children_come_from_the_first_list_trimmed() -> None:
    srcs = {k: Source([]) for k in KINDS}
    srcs["Deployment"].items = [obj("app-decode", 5, spec={"replicas": 2}), obj("other", 6, owner=None)]
    inf, changes = make(srcs)
    inf.start()
    try:
        kids = inf.children(("team", "app"))
        assert list(kids) == [("Deployment", "app-decode")]
        body = kids[("Deployment", "app-decode")]
        assert body["kind"] == "Deployment" and body["spec"] == {"replicas": 2}
        assert "managedFields" not in body["metadata"], "trimmed"
        assert changes.empty(), "the first list reports nothing: the owner handler reads it itself"
    finally:
        inf.stop()


def test_changes_are_reported_and_echoes_of_our_applies_are_not() -> None:
    srcs = {k: Source([]) for k in KINDS}
    inf, changes = make(srcs, known={("Service", "app-encode", "11")})
    inf.start()
    try:
        inf.wait_synced(10)
        svc = srcs["Service"]
        svc.events.put({"type": "ADDED", "object": obj("app-encode", 11)})  # our own apply's echo
        svc.events.put({"type": "MODIFIED", "object": obj("app-encode", 12, spec={"ports": []})})  # a hand edit
        key, kind, name, body = changes.get(timeout=10)
        assert (key, kind, name) == (("team", "app"), "Service", "app-encode")
        assert body["metadata"]["resourceVersion"] == "12"
        svc.events.put({"type": "DELETED", "object": obj("app-encode", 13)})
        assert changes.get(timeout=10) == (("team", "app"), "Service", "app-encode", None)
        assert inf.children(("team", "app")) == {}
        assert changes.empty()
    finally:
        inf.stop()


def test_expired_watch_relists_and_reports_what_vanished_meanwhile() -> None:
    srcs = {k: Source([]) for k in KINDS}
    cm = srcs["ConfigMap"]
    cm.items = [obj("app-config", 3, data={"k": "v"})]
    inf, changes = make(srcs)
    inf.start()
    try:
        assert ("ConfigMap", "app-config") in inf.children(("team", "app"))
        cm.items = []  # deleted while the watch was down
        cm.listed.clear()
        cm.events.put({"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}})
        assert changes.get(timeout=10) == (("team", "app"), "ConfigMap", "app-config", None)
        assert cm.lists == 2 and inf.children(("team", "app")) == {}
    finally:
        inf.stop()


def test_a_kopf_namespace_glob_is_watched_cluster_wide() -> None:
    """``--namespace 'team-*'`` is a kopf glob; the API lists a literal namespace or all of them."""
    from easerve_operator.reconcile.handlers import watched_namespaces

    assert watched_namespaces([]) is None
    assert watched_namespaces(["team-*"]) is None
    assert watched_namespaces(["a", "b"]) == ["a", "b"]
