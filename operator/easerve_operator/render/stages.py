"""Render the child objects of a disaggregated EPDDeployment: a pure function of the spec.

One ConfigMap carries the runtime configuration (JSON, through ``RuntimeConfig``); per stage
there is a Deployment and a Service. The frontend runs beside the encode worker in each encode
pod, so the encode Service is the deployment's HTTP entry point and no extra hop is added.

Pod templates carry a checksum of the part of the configuration that stage reads, so a change
of ``spec.encode.batchBound`` rolls the encode pods and leaves prefill and decode alone.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from easerve_runtime.api import (
    CONFIG_PATH,
    GPU_RESOURCE,
    HTTP_PORT,
    SYSTEM_PORT,
    EPDDeploymentSpec,
    RuntimeConfig,
    StageAllocation,
    dynamo_namespace,
)

STAGES = ("encode", "prefill", "decode")
TCP_MAX_MESSAGE = str(256 * 1024 * 1024)
GPU = GPU_RESOURCE

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
        "easerve.io/deployment": name,
    }
    if stage:
        out["app.kubernetes.io/component"] = stage
        out["easerve.io/stage"] = stage
    return out


def selector(name: str, stage: str) -> dict[str, str]:
    return {"easerve.io/deployment": name, "easerve.io/stage": stage}


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "easerve.io/v1alpha1",
        "kind": "EPDDeployment",
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
    spec = config.spec.wire()
    view = {k: spec.get(k) for k in STAGE_FIELDS[stage]}
    view["_dynamoNamespace"] = config.dynamo_namespace
    return hashlib.sha256(json.dumps(view, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(config: RuntimeConfig) -> str:
    return hashlib.sha256(config.to_json().encode()).hexdigest()[:16]


def _env(
    config: RuntimeConfig, system_port: int, extra: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    spec = config.spec
    env: list[dict[str, Any]] = [
        {"name": "DYN_NAMESPACE", "value": config.dynamo_namespace},
        {"name": "DYN_DISCOVERY_BACKEND", "value": str(spec.discovery.backend)},
        {"name": "DYN_REQUEST_PLANE", "value": "tcp"},
        {"name": "DYN_TCP_MAX_MESSAGE_SIZE", "value": TCP_MAX_MESSAGE},
        {"name": "DYN_SYSTEM_PORT", "value": str(system_port)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    if spec.discovery.etcd_endpoints:
        env.append({"name": "ETCD_ENDPOINTS", "value": spec.discovery.etcd_endpoints})
    env.extend(extra or [])
    for e in spec.pod.env or []:
        env.append({"name": e.name, "value": e.value})
    return env


def _probes(port: int | str) -> dict[str, Any]:
    return {
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": port},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/live", "port": port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
    }


def _container(
    config: RuntimeConfig,
    cname: str,
    stage_arg: str,
    gpus: int,
    ports: list[dict[str, Any]],
    shm: bool,
    extra_env: list[dict[str, Any]] | None = None,
    probe_port: int | str | None = "system",
    system_port: int = SYSTEM_PORT,
) -> dict[str, Any]:
    spec = config.spec
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    for kind, values in (spec.pod.resources or {}).items():
        resources.setdefault(kind, {}).update(values)
    if gpus:
        resources["requests"][GPU] = str(gpus)
        resources["limits"][GPU] = str(gpus)
    mounts = [{"name": "config", "mountPath": "/etc/easerve", "readOnly": True}]
    if shm:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    c: dict[str, Any] = {
        "name": cname,
        "image": spec.engine.image,
        # args, not command: the image's entrypoint (tini) stays PID 1 and reaps/forwards signals
        "args": ["easerve", "worker", "--stage", stage_arg, "--config", CONFIG_PATH],
        "env": _env(config, system_port, extra_env),
        "volumeMounts": mounts,
    }
    if ports:
        c["ports"] = ports
    if any(resources.values()):
        c["resources"] = {k: v for k, v in resources.items() if v}
    if probe_port is not None:
        c.update(_probes(probe_port))
    return c


def _pod_spec(config: RuntimeConfig, stage: str, alloc: StageAllocation) -> dict[str, Any]:
    spec = config.spec
    name = config.name
    system_port = [{"name": "system", "containerPort": SYSTEM_PORT, "protocol": "TCP"}]
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": config_map_name(name)}}]
    containers: list[dict[str, Any]]
    if stage == "encode":
        colocated = spec.has_local_prefill
        # The GPU is requested once, by the encode container; co-located sidecars split its SMs
        # through the shared-memory control record in /dev/shm. They get no device of their own:
        # never NVIDIA_VISIBLE_DEVICES=all (that exposes every GPU of the node to the pod).
        share: list[dict[str, Any]] = []
        containers = [
            _container(
                config,
                "frontend",
                "frontend",
                0,
                [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
                False,
                probe_port="http",
                system_port=SYSTEM_PORT + 1,
            ),
            _container(config, "encode", "encode", alloc.tensor_parallel, system_port, colocated),
        ]
        if colocated:
            containers.append(
                _container(
                    config,
                    "local-prefill",
                    "local-prefill",
                    0,
                    [{"name": "system-lp", "containerPort": SYSTEM_PORT + 2, "protocol": "TCP"}],
                    True,
                    share,
                    probe_port="system-lp",
                    system_port=SYSTEM_PORT + 2,
                )
            )
            pc = _container(
                config, "partition-controller", "partition-controller", 0, [], True, share, probe_port=None
            )
            # policy, static SMs and epsilon come from the same config the workers read
            pc["args"] = ["easerve", "partition-controller", "--config", CONFIG_PATH, "--gpu", "0"]
            containers.append(pc)
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    else:
        containers = [_container(config, stage, stage, alloc.tensor_parallel, system_port, False)]
    pod: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
    }
    if spec.pod.node_selector:
        pod["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod["tolerations"] = list(spec.pod.tolerations)
    return pod


def render_config_map(config: RuntimeConfig, owner: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_map_name(config.name),
            "namespace": config.namespace,
            "labels": labels(config.name),
            "annotations": {"easerve.io/config-hash": config_hash(config)},
            "ownerReferences": [owner],
        },
        "data": {"config.json": config.to_json()},
    }


def render_deployment(config: RuntimeConfig, stage: str, owner: dict[str, Any]) -> dict[str, Any]:
    alloc: StageAllocation = getattr(config.spec.allocation, stage)
    name = config.name
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": stage_name(name, stage),
            "namespace": config.namespace,
            "labels": labels(name, stage),
            "ownerReferences": [owner],
        },
        "spec": {
            "replicas": alloc.replicas,
            "selector": {"matchLabels": selector(name, stage)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": labels(name, stage),
                    "annotations": {
                        "easerve.io/config-hash": stage_config_hash(config, stage),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SYSTEM_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": _pod_spec(config, stage, alloc),
            },
        },
    }


def render_service(config: RuntimeConfig, stage: str, owner: dict[str, Any]) -> dict[str, Any]:
    # protocol is spelled out: server-side apply on Kubernetes 1.20 rejects ports without it
    ports = [{"name": "system", "port": SYSTEM_PORT, "targetPort": "system", "protocol": "TCP"}]
    if stage == "encode":
        ports.insert(0, {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": stage_name(config.name, stage),
            "namespace": config.namespace,
            "labels": labels(config.name, stage),
            "ownerReferences": [owner],
        },
        "spec": {"selector": selector(config.name, stage), "ports": ports},
    }
