"""Spec -> child objects, as plain dicts. Pure: no cluster, no kopf, deterministic output.

``render_children`` is what both the reconciler and ``easerve render`` call; golden-file tests
pin its output.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import DeploymentMode, EPDDeploymentSpec

from easerve_operator.render.stages import (
    STAGES,
    owner_reference,
    render_config_map,
    render_deployment,
    render_service,
    runtime_config,
)

__all__ = ["render_children", "STAGES"]


def render_children(name: str, namespace: str, uid: str, spec: EPDDeploymentSpec) -> list[dict[str, Any]]:
    """Every object the operator keeps in line for one EPDDeployment, in apply order."""
    config = runtime_config(name, namespace, spec)
    owner = owner_reference(name, uid)
    out: list[dict[str, Any]] = [render_config_map(config, owner)]
    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        from easerve_operator.render.omni import render_omni  # omni-colocated: one pod per GPU

        out.extend(render_omni(name, namespace, spec, config.to_json(), owner))
        return out
    out.extend(render_deployment(config, stage, owner) for stage in STAGES)
    out.extend(render_service(config, stage, owner) for stage in STAGES)
    return out
