"""The model directory's volume (``spec.model.volume``): a PVC or a node path, read-only.

Mounted into every container that reads the model directory: the stage workers (their weights,
processor and tokenizer) and the frontend (the tokenizer that renders tokens to text). Partition
controllers never read it. Pure: dicts in, dicts out.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import EPDDeploymentSpec, Stage
from easerve_runtime.topology import Process

VOLUME = "model"


def model_volumes(spec: EPDDeploymentSpec) -> list[dict[str, Any]]:
    v = spec.model.volume
    if v is None:
        return []
    if v.persistent_volume_claim:
        return [{"name": VOLUME, "persistentVolumeClaim": {"claimName": v.persistent_volume_claim, "readOnly": True}}]
    return [{"name": VOLUME, "hostPath": {"path": v.host_path, "type": "Directory"}}]


def model_mounts(spec: EPDDeploymentSpec, proc: Process) -> list[dict[str, Any]]:
    v = spec.model.volume
    if v is None or proc.stage == Stage.PARTITION_CONTROLLER:
        return []
    return [{"name": VOLUME, "mountPath": v.mount_path, "readOnly": True}]
