"""Spec -> child objects, as plain dicts. Pure: no cluster, no kopf, deterministic output.

``render_children`` is what both the reconciler and ``easerve render`` call; golden-file tests
pin its output. Layout (which pods, which processes, who owns which GPU) comes from
``easerve_runtime.topology.plan``; ``render/pods.py`` spells it as Kubernetes objects with one
set of helpers for every mode.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import EPDDeploymentSpec
from easerve_runtime.topology import Hardware, Topology, plan

from easerve_operator.render.pods import render_deployment, render_service
from easerve_operator.render.stages import (
    STAGES,
    owner_reference,
    render_config_map,
    runtime_config,
    stage_config_hash,
)

__all__ = ["render_children", "render_topology", "STAGES"]


def render_topology(
    name: str, namespace: str, uid: str, spec: EPDDeploymentSpec, topology: Topology
) -> list[dict[str, Any]]:
    """The ConfigMap, then a Deployment per pod shape, then a Service per pod shape."""
    config = runtime_config(name, namespace, spec)
    owner = owner_reference(name, uid)
    out: list[dict[str, Any]] = [render_config_map(config, owner)]
    out.extend(
        render_deployment(config, pod, owner, stage_config_hash(config, str(pod.stage))) for pod in topology.pods
    )
    out.extend(render_service(config, pod, owner) for pod in topology.pods)
    return out


def render_children(
    name: str, namespace: str, uid: str, spec: EPDDeploymentSpec, hardware: Hardware | None = None
) -> list[dict[str, Any]]:
    """Every object the operator keeps in line for one EPDDeployment, in apply order.

    ``hardware`` (what the layout needs from the latency profile) defaults to the shipped
    profile that ``spec.engine.profile`` names.
    """
    return render_topology(name, namespace, uid, spec, plan(spec, hardware))
