"""The profile ConfigMap's volume and mount (``spec.engine.profileConfigMap``), for every pod.

The runtime reads ``PROFILE_DIR/PROFILE_KEY`` (``easerve_runtime.profiles.spec_profile``); this is
the one place the renderer puts it there. The mount nests inside the config volume's directory,
which the kubelet supports for ConfigMap volumes (it creates the mount point, kubernetes#60342).
Nothing is rendered when the spec names a shipped profile or a file.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import PROFILE_DIR, PROFILE_KEY, EPDDeploymentSpec

VOLUME = "profile"


def profile_volumes(spec: EPDDeploymentSpec) -> list[dict[str, Any]]:
    cm = spec.engine.profile_config_map
    if cm is None:
        return []
    return [{"name": VOLUME, "configMap": {"name": cm, "items": [{"key": PROFILE_KEY, "path": PROFILE_KEY}]}}]


def profile_mounts(spec: EPDDeploymentSpec) -> list[dict[str, Any]]:
    if spec.engine.profile_config_map is None:
        return []
    return [{"name": VOLUME, "mountPath": PROFILE_DIR, "readOnly": True}]
