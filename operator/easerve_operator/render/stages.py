"""Names, labels and the runtime ConfigMap of an EPDDeployment's children: pure functions.

One ConfigMap carries the runtime configuration (JSON, through ``RuntimeConfig``). Pod templates
carry a checksum of the part of the configuration that stage reads, so a change of
``spec.encode.batchBound`` rolls the encode pods and leaves prefill and decode alone. The pods
themselves are rendered from the topology by ``render/pods.py``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from easerve_runtime.api import (
    ANNOTATION_CONFIG_HASH,
    API_VERSION,
    KIND,
    LABEL_DEPLOYMENT,
    LABEL_STAGE,
    EPDDeploymentSpec,
    RuntimeConfig,
    Stage,
    dynamo_namespace,
)
from easerve_runtime.policies.knobs import LIVE_FIELDS

STAGES = (str(Stage.ENCODE), str(Stage.PREFILL), str(Stage.DECODE))

# Which parts of the spec each stage's processes read: the config hash of a stage covers only these.
_COMMON = ("model", "engine", "discovery", "mode", "observability")
STAGE_FIELDS: dict[str, tuple[str, ...]] = {
    "encode": _COMMON + ("encode", "offload", "smPartition", "slo"),  # + frontend and local prefill
    "prefill": _COMMON,
    "decode": _COMMON,
}


def labels(name: str, stage: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "easerve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "easerve-operator",
        LABEL_DEPLOYMENT: name,
    }
    if stage:
        out["app.kubernetes.io/component"] = stage
        out[LABEL_STAGE] = stage
    return out


def selector(name: str, stage: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: name, LABEL_STAGE: stage}


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_name(name: str, suffix: str) -> str:
    """A DNS-1035 label (Service names allow no dots) of at most 63 characters, stable per input.

    ``llava-v1.6-34b`` + ``encode`` gives ``llava-v1-6-34b-encode``; over-long names are cut
    and made unique again with a short hash of the full name.
    """
    base = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    if not base or not base[0].isalpha():
        base = f"e-{base}"
    full = f"{base}-{suffix}"
    if len(full) <= 63:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{base[: 63 - len(suffix) - 8].rstrip('-')}-{digest}-{suffix}"


def config_map_name(name: str) -> str:
    return child_name(name, "config")


def stage_name(name: str, stage: str) -> str:
    return child_name(name, stage)


def runtime_config(name: str, namespace: str, spec: EPDDeploymentSpec) -> RuntimeConfig:
    return RuntimeConfig(
        name=name, namespace=namespace, dynamo_namespace=dynamo_namespace(namespace, name), spec=spec
    )


def stage_config_hash(config: RuntimeConfig, stage: str) -> str:
    """Hash of what the processes of ``stage``'s pods read; the whole config for a stage (omni)
    not in ``STAGE_FIELDS``. The encode pods' hash leaves out the live knobs (B, the dispatch
    parameters, s: ``policies.knobs.LIVE_FIELDS``): their workers follow the ConfigMap and take
    a change without a restart, so it must not roll them. A change of s across 1 still rolls: the
    pod's containers differ (local prefill)."""
    if stage not in STAGE_FIELDS:
        return config_hash(config)
    spec = config.spec.wire()
    view = {k: spec.get(k) for k in STAGE_FIELDS[stage]}
    if stage == str(Stage.ENCODE):  # live knobs reach running workers through the ConfigMap: no roll
        for sec, fields in LIVE_FIELDS.items():
            part = view.get(sec)
            if isinstance(part, dict):
                view[sec] = {k: v for k, v in part.items() if k not in fields}
    view["_dynamoNamespace"] = config.dynamo_namespace
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(config: RuntimeConfig) -> str:
    return hashlib.sha256(config.to_json().encode()).hexdigest()[:16]


def render_config_map(config: RuntimeConfig, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(config.name),
            "namespace": config.namespace,
            "labels": labels(config.name),
            "annotations": {ANNOTATION_CONFIG_HASH: config_hash(config)},
            "ownerReferences": [owner],
        },
        "data": {"config.json": config.to_json()},
    }
