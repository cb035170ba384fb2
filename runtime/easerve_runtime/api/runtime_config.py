"""What a worker reads from its ConfigMap: where it is, and the spec it serves."""

from __future__ import annotations

import json

from pydantic import Field

from easerve_runtime.api.spec import EPDDeploymentSpec, Model


class RuntimeConfig(Model):
    """What a worker pod reads from its ConfigMap: where it is, and the spec it serves."""

    name: str
    namespace: str = "default"
    dynamo_namespace: str = Field(description="Dynamo namespace: endpoints are <ns>.<stage>.generate.")
    spec: EPDDeploymentSpec

    def to_json(self) -> str:
        return json.dumps(self.wire(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RuntimeConfig:
        return cls.model_validate_json(text)


def dynamo_namespace(namespace: str, name: str) -> str:
    """Dynamo namespaces are dotted paths; keep them free of dots and dashes."""
    return f"{namespace}_{name}".replace("-", "_").replace(".", "_")

