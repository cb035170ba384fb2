"""The API-key Secret (``spec.auth.apiKeySecret``): mounted as a file into the frontend only.

The frontend keeps only hashes of the keys it reads (``EASERVE_API_KEYS_FILE``); workers never see
the Secret, so a worker's logs, metrics or crash dumps cannot leak it. Omni pods do not take API
keys yet. Nothing is rendered when the spec names no Secret.
"""

from __future__ import annotations

from typing import Any

from easerve_runtime.api import RuntimeConfig, Stage
from easerve_runtime.topology import Pod, Process

API_KEYS_DIR = "/etc/easerve-keys"
VOLUME = "api-keys"
KEYS_FILE = f"{API_KEYS_DIR}/api-keys"


def _takes_keys(proc: Process) -> bool:
    return proc.stage == Stage.FRONTEND


def api_key_volumes(config: RuntimeConfig, pod: Pod) -> list[dict[str, Any]]:
    auth = config.spec.auth
    if not auth.api_key_secret or not any(_takes_keys(p) for p in pod.processes):
        return []
    items = [{"key": auth.api_key_secret_key, "path": "api-keys"}]
    return [{"name": VOLUME, "secret": {"secretName": auth.api_key_secret, "items": items}}]


def api_key_mounts(config: RuntimeConfig, proc: Process) -> list[dict[str, Any]]:
    if not config.spec.auth.api_key_secret or not _takes_keys(proc):
        return []
    return [{"name": VOLUME, "mountPath": API_KEYS_DIR, "readOnly": True}]


def api_key_env(config: RuntimeConfig, proc: Process) -> list[dict[str, Any]]:
    if not config.spec.auth.api_key_secret or not _takes_keys(proc):
        return []
    return [{"name": "EASERVE_API_KEYS_FILE", "value": KEYS_FILE}]
