"""Render an omni-colocated EPDDeployment: one pod per GPU holding every stage of the omni model.

HorizonServe's premise (§4, §5) is that the shared stage (thinker) and the downstream stage
(talker/codec or diffusion) run as separate processes on ONE GPU, coordinated through a small
control record in ``/dev/shm``. The layout (``omni-shared`` owning the GPU and serving HTTP,
``omni-downstream`` sharing it, the ``partition-controller`` running the bandwidth throttle with
the profile's SM ladder) is decided by ``easerve_runtime.topology.plan``; the objects are
spelled by the same helpers as the disaggregated pods (``render/pods.py``).
"""

from __future__ import annotations

import hashlib
from typing import Any

from easerve_runtime.api import DeploymentMode, EPDDeploymentSpec, SpecError, dynamo_namespace
from easerve_runtime.topology import plan

from easerve_operator.render.pods import render_deployment, render_service
from easerve_operator.render.stages import runtime_config


def render_omni(
    name: str, namespace: str, spec: EPDDeploymentSpec, config_json: str, owner_ref: dict[str, Any]
) -> list[dict[str, Any]]:
    """The Deployment and Service of an omni-colocated deployment (the ConfigMap is the caller's).

    ``config_json`` is the runtime ConfigMap's ``config.json``; its hash goes on the pod template
    so a configuration change (e.g. a recalibrated SLO) rolls pods.
    """
    if spec.mode != DeploymentMode.OMNI_COLOCATED:
        raise SpecError("spec.mode", f"render_omni needs omni-colocated, got {spec.mode}")
    config = runtime_config(name, namespace, spec)
    assert config.dynamo_namespace == dynamo_namespace(namespace, name)
    (pod,) = plan(spec).pods
    digest = hashlib.sha256(config_json.encode()).hexdigest()[:16]
    return [render_deployment(config, pod, owner_ref, digest), render_service(config, pod, owner_ref)]
