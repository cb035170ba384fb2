"""Pods from the topology: ONE set of helpers for every mode (disaggregated, aggregated, omni-colocated).

``easerve_runtime.topology.plan`` decides what runs where (pods, processes, GPU ownership and
sharing, ports, argv); these helpers only spell each ``Pod`` as a Deployment and Service and
each ``Process`` as a container: labels, environment, probes, volumes, resources and scheduling
fields come from here for every container of every mode, so they cannot drift apart.

Mode-specific on purpose: only Dynamo processes (disaggregated, aggregated) get Dynamo's environment (the
omni-colocated runtime does not use Dynamo). Pure: dicts in, dicts out.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import (
    ANNOTATION_CONFIG_HASH,
    CONFIG_DIR,
    GPU_RESOURCE,
    SYSTEM_PORT,
    DeploymentMode,
    RuntimeConfig,
)
from easerve_runtime.topology import Pod, Port, Process

from easerve_operator.render.auth import api_key_env, api_key_mounts, api_key_volumes
from easerve_operator.render.model import model_mounts, model_volumes
from easerve_operator.render.profile import profile_mounts, profile_volumes
from easerve_operator.render.stages import config_map_name, labels, selector, stage_name

TCP_MAX_MESSAGE = str(256 * 1024 * 1024)
TERMINATION_GRACE_S = 60
READINESS = {"periodSeconds": 5, "failureThreshold": 3}
LIVENESS = {"periodSeconds": 10, "failureThreshold": 6}
ENDPOINT_DRAIN_S = 5
"""How long an HTTP-serving container keeps serving after its pod is marked for deletion.

Kubernetes removes a terminating pod from the Service's endpoints and sends SIGTERM at the same
time, and the endpoint removal reaches kube-proxy (or a mesh) a moment later. Without this preStop
pause a frontend stops listening while connections are still routed to it, and those are reset."""


def _downward(field: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": field}}}


def container_env(config: RuntimeConfig, proc: Process) -> list[dict[str, Any]]:
    """Dynamo's variables (disaggregated and aggregated modes), the downward API, the process's own, the user's."""
    spec = config.spec
    dynamo = spec.mode != DeploymentMode.OMNI_COLOCATED  # disaggregated and aggregated run over Dynamo
    env: list[dict[str, Any]] = []
    if dynamo:
        env += [
            {"name": "DYN_NAMESPACE", "value": config.dynamo_namespace},
            {"name": "DYN_DISCOVERY_BACKEND", "value": str(spec.discovery.backend)},
            {"name": "DYN_REQUEST_PLANE", "value": "tcp"},
            {"name": "DYN_TCP_MAX_MESSAGE_SIZE", "value": TCP_MAX_MESSAGE},
            {"name": "DYN_SYSTEM_PORT", "value": str(proc.system_port or SYSTEM_PORT)},
        ]
    env += [
        {"name": "POD_NAME", **_downward("metadata.name")},
        {"name": "POD_NAMESPACE", **_downward("metadata.namespace")},
    ]
    if dynamo:
        env.append({"name": "POD_UID", **_downward("metadata.uid")})
        if spec.discovery.etcd_endpoints:
            env.append({"name": "ETCD_ENDPOINTS", "value": spec.discovery.etcd_endpoints})
    env += [{"name": k, "value": v} for k, v in proc.env]
    env += api_key_env(config, proc)
    env += [{"name": e.name, "value": e.value} for e in spec.pod.env or []]
    return env


def probes(port: str) -> dict[str, Any]:
    """Readiness on /health (taken out of the Service while not ready), liveness on /live."""
    return {
        "readinessProbe": {"httpGet": {"path": "/health", "port": port}, **READINESS},
        "livenessProbe": {"httpGet": {"path": "/live", "port": port}, **LIVENESS},
    }


def resources(config: RuntimeConfig, gpus: int) -> dict[str, dict[str, str]]:
    """The user's requests/limits plus the GPUs this container owns (the allocation sets them)."""
    out: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    for kind, values in (config.spec.pod.resources or {}).items():
        out.setdefault(kind, {}).update(values)
    if gpus:
        out["requests"][GPU_RESOURCE] = str(gpus)
        out["limits"][GPU_RESOURCE] = str(gpus)
    return {k: v for k, v in out.items() if v}


def volume_mounts(config: RuntimeConfig, proc: Process) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if proc.shm:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    mounts.extend(profile_mounts(config.spec))
    mounts.extend(model_mounts(config.spec, proc))
    mounts.extend(api_key_mounts(config, proc))
    return mounts


def volumes(config: RuntimeConfig, pod: Pod) -> list[dict[str, Any]]:
    """The pod's volumes; a new one (e.g. a profile ConfigMap) is one more entry here and in
    ``volume_mounts``."""
    out: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": config_map_name(config.name)}}]
    if pod.shm:
        out.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
    out.extend(profile_volumes(config.spec))
    out.extend(model_volumes(config.spec))
    out.extend(api_key_volumes(config, pod))
    return out


def container_ports(ports: tuple[Port, ...]) -> list[dict[str, Any]]:
    # protocol is spelled out: server-side apply on Kubernetes 1.20 rejects ports without it
    return [{"name": p.name, "containerPort": p.number, "protocol": "TCP"} for p in ports]


def container(config: RuntimeConfig, proc: Process) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": proc.name,
        "image": config.spec.engine.image,
        # args, not command: the image's entrypoint (tini) stays PID 1 and reaps/forwards signals
        "args": list(proc.argv),
        "env": container_env(config, proc),
        "volumeMounts": volume_mounts(config, proc),
    }
    if proc.ports:
        c["ports"] = container_ports(proc.ports)
    res = resources(config, proc.gpus)
    if res:
        c["resources"] = res
    if proc.probe is not None:
        c.update(probes(proc.probe))
    if proc.http_port is not None:
        c["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(ENDPOINT_DRAIN_S)]}}}
    return c


def scheduling(config: RuntimeConfig) -> dict[str, Any]:
    """nodeSelector and tolerations: the same for every pod of every mode."""
    pod = config.spec.pod
    out: dict[str, Any] = {}
    if pod.node_selector:
        out["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        out["tolerations"] = list(pod.tolerations)
    return out


def rollout_strategy(replicas: int) -> dict[str, Any]:
    """How a stage's pods are replaced on an update.

    Several replicas: one down at a time and no extra pod (``maxSurge 0``): GPUs are the scarce
    resource, and the others carry the load meanwhile. One replica: the new pod first (``maxSurge
    1, maxUnavailable 0``, Kubernetes' own default for one replica), because taking the only pod
    down first is an outage of the stage. That update needs the pod's GPUs free once; where none
    are, the new pod stays Pending and the old one keeps serving until they are.
    """
    if replicas <= 1:
        return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def pod_spec(config: RuntimeConfig, pod: Pod) -> dict[str, Any]:
    return {
        "containers": [container(config, p) for p in pod.processes],
        "volumes": volumes(config, pod),
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
        **scheduling(config),
    }


def render_deployment(config: RuntimeConfig, pod: Pod, owner: dict[str, Any], config_hash: str) -> dict[str, Any]:
    """``config_hash`` goes on the pod template: a change of what the pods read rolls them."""
    name, stage = config.name, str(pod.stage)
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
            "replicas": pod.replicas,
            "selector": {"matchLabels": selector(name, stage)},
            "strategy": rollout_strategy(pod.replicas),
            "template": {
                "metadata": {
                    "labels": labels(name, stage),
                    "annotations": {
                        ANNOTATION_CONFIG_HASH: config_hash,
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(pod.metrics_port),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec(config, pod),
            },
        },
    }


def render_service(config: RuntimeConfig, pod: Pod, owner: dict[str, Any]) -> dict[str, Any]:
    name, stage = config.name, str(pod.stage)
    ports = [{"name": p.name, "port": p.number, "targetPort": p.name, "protocol": "TCP"} for p in pod.service_ports]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": stage_name(name, stage),
            "namespace": config.namespace,
            "labels": labels(name, stage),
            "ownerReferences": [owner],
        },
        "spec": {"selector": selector(name, stage), "ports": ports},
    }
