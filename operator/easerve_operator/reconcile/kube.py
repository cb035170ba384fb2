"""The thin I/O shell over the Kubernetes API: server-side apply of children, status patches.

Server-side apply with our own field manager makes every write idempotent and lets the API
server remove fields we stopped rendering; ``force`` takes back fields someone edited by hand,
which is exactly what drift repair means. Callers decide *whether* to write (see drift.py);
this module only knows *how*.
"""

from __future__ import annotations

import json
import os
from typing import Any

from easerve_runtime.api import GROUP, LABEL_DEPLOYMENT, PLURAL, VERSION
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from easerve_operator.reconcile.loop import ClientError

FIELD_MANAGER = "easerve-operator"

_METHODS = {  # kind -> (api class, method suffix)
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "Service": (client.CoreV1Api, "service"),
    "Deployment": (client.AppsV1Api, "deployment"),
}


class Kube:
    """One API client for the operator's own writes (kopf keeps its own for watching).

    Implements ``loop.Client``; refusals surface as ``loop.ClientError``."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api = api_client or new_api_client()
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def _method(self, kind: str, verb: str) -> Any:
        cls, suffix = _METHODS[kind]
        api = self.core if cls is client.CoreV1Api else self.apps
        return getattr(api, f"{verb}_namespaced_{suffix}")

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply one child (creates it when missing); returns the live object."""
        meta = obj["metadata"]
        try:
            resp = self._method(obj["kind"], "patch")(
                meta["name"],
                meta["namespace"],
                obj,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type="application/apply-patch+yaml",
                _preload_content=False,
            )
        except ApiException as exc:
            raise ClientError(int(exc.status or 0), str(exc.reason)) from exc
        return json.loads(resp.data)  # type: ignore[no-any-return]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self._method(kind, "delete")(name, namespace)
        except ApiException as exc:
            raise ClientError(int(exc.status or 0), str(exc.reason)) from exc

    def unschedulable_pods(self, namespaces: list[str] | None) -> dict[tuple[str, str], list[str]]:
        """Per owner (namespace, name): ``"pod: message"`` for each unbound pod the scheduler marked
        Unschedulable. One list per scope for every owner (a field selector keeps it to unbound pods)."""
        out: dict[tuple[str, str], list[str]] = {}
        kw: dict[str, Any] = {
            "label_selector": LABEL_DEPLOYMENT,
            "field_selector": "spec.nodeName=",
            "_preload_content": False,
        }
        for ns in namespaces or [None]:
            resp = (
                self.core.list_pod_for_all_namespaces(**kw)
                if ns is None
                else self.core.list_namespaced_pod(ns, **kw)
            )
            for pod in json.loads(resp.data)["items"]:
                meta = pod["metadata"]
                for c in (pod.get("status") or {}).get("conditions") or []:
                    if (
                        c.get("type") == "PodScheduled"
                        and c.get("status") == "False"
                        and c.get("reason") == "Unschedulable"
                    ):
                        key = (meta["namespace"], meta["labels"][LABEL_DEPLOYMENT])
                        out.setdefault(key, []).append(f"{meta['name']}: {c.get('message', 'Unschedulable')}")
        return {k: sorted(v) for k, v in out.items()}

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the EPDDeployment's status subresource (never its spec)."""
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:  # the owner was deleted meanwhile: nothing to report on
                raise


def new_api_client() -> client.ApiClient:
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = 16
    return client.ApiClient(cfg)
