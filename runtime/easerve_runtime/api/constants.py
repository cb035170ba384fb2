"""Names every side of EAServe agrees on: the API group, label keys, ports, paths, stage names.

The renderer writes them into pods, the workers listen on them, the operator selects by them and
the twin names its workers with them; one definition each, so they cannot drift apart.
"""

from __future__ import annotations

from enum import StrEnum

GROUP = "easerve.io"
VERSION = "v1alpha1"
KIND = "EPDDeployment"
PLURAL = "epddeployments"
API_VERSION = f"{GROUP}/{VERSION}"
TIER_NAMES = ("strict", "tight", "moderate", "loose", "relaxed")


class Stage(StrEnum):
    """A process kind of a deployment (``easerve worker --stage`` takes all but the partition
    controller, which is its own command, and ``omni``, the omni pod's label)."""

    FRONTEND = "frontend"
    ENCODE = "encode"
    LOCAL_PREFILL = "local-prefill"
    PREFILL = "prefill"
    DECODE = "decode"
    PARTITION_CONTROLLER = "partition-controller"
    OMNI = "omni"
    """The omni-colocated pod (its Deployment's stage label); its processes are the two below."""
    OMNI_SHARED = "omni-shared"
    OMNI_DOWNSTREAM = "omni-downstream"
    AGGREGATED = "aggregated"
    """``spec.mode: aggregated``: one process doing encode, prefill and decode (its pod's label too)."""


# Label and annotation keys
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_STAGE = f"{GROUP}/stage"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
FINALIZER = f"{GROUP}/finalizer"

# Ports and paths inside a pod
HTTP_PORT = 8000
"""The OpenAI-compatible frontend."""
SYSTEM_PORT = 9090
"""Dynamo's system server of a worker: /health, /live, /metrics."""
CONFIG_DIR = "/etc/easerve"
CONFIG_PATH = f"{CONFIG_DIR}/config.json"
GPU_RESOURCE = "nvidia.com/gpu"
PROFILE_DIR = f"{CONFIG_DIR}/profile"
"""Where the renderer mounts ``spec.engine.profileConfigMap`` (a nested mount inside the config
volume; the kubelet creates its mount point, kubernetes/kubernetes#60342)."""
PROFILE_KEY = "profile.json"
"""The key of that ConfigMap the runtime reads: ``PROFILE_DIR/PROFILE_KEY``."""
PROFILE_DIR_ENV = "EASERVE_PROFILE_DIR"
"""Overrides ``PROFILE_DIR`` outside a pod (``easerve up``, tests): a directory holding profile.json."""
