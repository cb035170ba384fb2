"""Render an omni-colocated EPDDeployment: one pod per GPU holding every stage of the omni model.

HorizonServe's premise (§4, §5) is that the shared stage (thinker) and the downstream stage
(talker/codec or diffusion) run as separate processes on ONE GPU, coordinated through a small
control record in ``/dev/shm`` (downstream activity, the SM split, the bandwidth EWMA). So the
pod has three containers sharing a memory-backed ``/dev/shm``:

- ``omni-shared``: the HTTP front door and the shared stage, driven by the omni scheduler; it
  requests the pod's one GPU;
- ``omni-downstream``: the downstream stage on the same GPU (no device of its own is requested; never ``NVIDIA_VISIBLE_DEVICES=all``);
- ``partition-controller``: applies the shared stage's SM cap (BandwidthThrottle) each step.

``gpuBudget`` pods (one GPU each) sit behind one Service. Pure: dicts in, dicts out.
"""

from __future__ import annotations

import hashlib
from typing import Any

from easerve_runtime.api import CONFIG_PATH, GPU_RESOURCE, HTTP_PORT, SYSTEM_PORT, EPDDeploymentSpec

from easerve_operator.render.stages import config_map_name, stage_name

STAGE = "omni"
GPU = GPU_RESOURCE


def _labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "easerve",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "easerve-operator",
        "app.kubernetes.io/component": STAGE,
        "easerve.io/deployment": name,
        "easerve.io/stage": STAGE,
    }


def _selector(name: str) -> dict[str, str]:
    return {"easerve.io/deployment": name, "easerve.io/stage": STAGE}


def _env(spec: EPDDeploymentSpec, extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        *extra,
    ]
    env.extend({"name": e.name, "value": e.value} for e in spec.pod.env or [])
    return env


def _container(
    spec: EPDDeploymentSpec,
    cname: str,
    command: list[str],
    ports: list[dict[str, Any]],
    gpu: bool,
    extra_env: list[dict[str, Any]],
    probe_port: str | None,
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": cname,
        "image": spec.engine.image,
        "args": command,  # args, not command: the image entrypoint (tini) stays PID 1
        "env": _env(spec, extra_env),
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/easerve", "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
        ],
    }
    if ports:
        c["ports"] = ports
    resources: dict[str, dict[str, str]] = {}
    for kind, values in (spec.pod.resources or {}).items():
        resources.setdefault(kind, {}).update(values)
    if gpu:
        resources.setdefault("requests", {})[GPU] = "1"
        resources.setdefault("limits", {})[GPU] = "1"
    if resources:
        c["resources"] = resources
    if probe_port is not None:
        c["readinessProbe"] = {"httpGet": {"path": "/health", "port": probe_port}, "periodSeconds": 5}
        c["livenessProbe"] = {
            "httpGet": {"path": "/live", "port": probe_port},
            "periodSeconds": 10,
            "failureThreshold": 6,
        }
    return c


def render_omni(
    name: str, namespace: str, spec: EPDDeploymentSpec, config_json: str, owner_ref: dict[str, Any]
) -> list[dict[str, Any]]:
    """The Deployment and Service of an omni-colocated deployment (the ConfigMap is the caller's).

    ``config_json`` is the runtime ConfigMap's ``config.json`` (mounted at /etc/easerve); its
    hash goes on the pod template so a configuration change (e.g. a recalibrated SLO) rolls pods.
    """
    if spec.mode != "omni-colocated":
        raise ValueError(f"spec.mode: render_omni needs omni-colocated, got {spec.mode}")
    if spec.omni is None:
        raise ValueError("spec.omni: is required when spec.mode is omni-colocated")
    share: list[dict[str, Any]] = []  # never NVIDIA_VISIBLE_DEVICES=all: only requested devices
    worker = ["easerve", "worker", "--config", CONFIG_PATH, "--stage"]
    containers = [
        _container(
            spec,
            "omni-shared",
            [*worker, "omni-shared"],
            [
                {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                {"name": "system", "containerPort": SYSTEM_PORT, "protocol": "TCP"},
            ],
            True,
            [],
            "http",
        ),
        _container(
            spec,
            "omni-downstream",
            [*worker, "omni-downstream"],
            [{"name": "system-dn", "containerPort": SYSTEM_PORT + 1, "protocol": "TCP"}],
            False,
            share + [{"name": "DYN_SYSTEM_PORT", "value": str(SYSTEM_PORT + 1)}],
            "system-dn",
        ),
        _container(
            spec,
            "partition-controller",
            [
                "easerve",
                "partition-controller",
                "--config",
                CONFIG_PATH,
                "--gpu",
                "0",
                "--policy",
                "bandwidth-throttle",
            ],
            [],
            False,
            share,
            None,
        ),
    ]
    pod: dict[str, Any] = {
        "containers": containers,
        "volumes": [
            {"name": "config", "configMap": {"name": config_map_name(name)}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ],
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
    }
    if spec.pod.node_selector:
        pod["nodeSelector"] = dict(spec.pod.node_selector)
    if spec.pod.tolerations:
        pod["tolerations"] = list(spec.pod.tolerations)
    meta = {"namespace": namespace, "labels": _labels(name), "ownerReferences": [owner_ref]}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": stage_name(name, STAGE), **meta},
        "spec": {
            "replicas": spec.gpu_budget,
            "selector": {"matchLabels": _selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": _labels(name),
                    "annotations": {
                        "easerve.io/config-hash": hashlib.sha256(config_json.encode()).hexdigest()[:16],
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(HTTP_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": stage_name(name, STAGE), **meta},
        "spec": {
            "selector": _selector(name),
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "system", "port": SYSTEM_PORT, "targetPort": "system", "protocol": "TCP"},
            ],
        },
    }
    return [deployment, service]
