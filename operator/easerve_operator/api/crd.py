"""Generate the EPDDeployment CustomResourceDefinition from the pydantic models.

The models are the single source of truth; ``crds/`` holds the generated output and a test
fails when it drifts. Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural*
OpenAPI v3 subset, so this module translates: ``$ref`` inlined, ``anyOf [X, null]`` becomes
``X`` + ``nullable``, numeric exclusive bounds become the boolean OpenAPI form, free-form
maps get ``x-kubernetes-preserve-unknown-fields``.

Defaults are deliberately *not* written into the CRD: the API server would then persist them
into every object, and GitOps tools would see fields the user never wrote as drift. The
runtime applies the same defaults through the same models instead.
"""

from __future__ import annotations

from typing import Any

import yaml
from easerve_runtime.api import GROUP, KIND, LABEL_VALUE_MAX, PLURAL, VERSION, EPDDeploymentSpec
from easerve_runtime.api.status import EPDDeploymentStatus

SHORT_NAMES = ["epd"]


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return {k: _resolve(v, defs) for k, v in node.items() if k != "$defs"}


def _openapi(node: dict[str, Any]) -> dict[str, Any]:
    """Translate one resolved JSON-Schema node into structural OpenAPI v3."""
    node = dict(node)
    desc = node.get("description")
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        nullable = len(variants) < len(node["anyOf"])
        if len(variants) != 1:
            raise ValueError(
                f"cannot express anyOf with {len(variants)} non-null variants in a structural schema"
            )
        inner = _openapi(variants[0])
        if nullable:
            inner["nullable"] = True
        if desc and "description" not in inner:
            inner["description"] = desc
        if "pattern" in node and "pattern" not in inner:  # json_schema_extra on an optional field
            inner["pattern"] = node["pattern"]
        return inner
    out: dict[str, Any] = {}
    if desc:
        out["description"] = desc
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        first = node["enum"][0]
        node["type"] = "integer" if isinstance(first, int) else "string"
    typ = node.get("type")
    if typ:
        out["type"] = typ
    for key in ("enum", "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum"):
        if key in node:
            out[key] = node[key]
    if "exclusiveMinimum" in node:
        out["minimum"] = node["exclusiveMinimum"]
        out["exclusiveMinimum"] = True
    if "exclusiveMaximum" in node:
        out["maximum"] = node["exclusiveMaximum"]
        out["exclusiveMaximum"] = True
    if typ == "object":
        props = node.get("properties")
        addl = node.get("additionalProperties")
        if props:
            out["properties"] = {k: _openapi(v) for k, v in props.items()}
            if node.get("required"):
                out["required"] = sorted(node["required"])
        elif isinstance(addl, dict) and addl:
            out["additionalProperties"] = _openapi(addl)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif typ == "array":
        out["items"] = _openapi(node.get("items") or {"type": "object"})
    elif not typ:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")  # type: ignore[attr-defined]
    return _openapi(_resolve(raw, raw.get("$defs", {})))


def build_crd() -> dict[str, Any]:
    spec_schema = _schema_of(EPDDeploymentSpec)
    spec_schema["description"] = "Desired state of a multimodal encode/prefill/decode deployment."
    status_schema = _schema_of(EPDDeploymentStatus)
    status_schema["description"] = "Observed state, written by the operator only."
    # kopf keeps its own bookkeeping under status.kopf; everything else the operator writes is
    # declared by the models, so the API server prunes nothing it writes (and any field it did
    # not declare would be pruned, which a test on a real API server would show).
    status_schema["properties"]["kopf"] = {
        "type": "object",
        "description": "kopf's own bookkeeping (handler progress, last handled spec).",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": ".status.readySummary",
            "description": "Ready/desired E,P,D",
        },
        {"name": "E/P/D", "type": "string", "jsonPath": ".status.effective.allocationLabel"},
        {"name": "B", "type": "integer", "jsonPath": ".status.effective.batchBound"},
        {"name": "s", "type": "number", "jsonPath": ".status.effective.offloadRatio"},
        {"name": "Tuning", "type": "string", "jsonPath": ".status.tuning.phase", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": SHORT_NAMES,
                "categories": ["easerve"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "EPDDeployment serves a multimodal LLM as encode, prefill and decode pools.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {
                                    "type": "object",
                                    "properties": {
                                        # children carry metadata.name as a label value (63 chars)
                                        "name": {"type": "string", "maxLength": LABEL_VALUE_MAX},
                                        "generateName": {"type": "string", "maxLength": LABEL_VALUE_MAX - 5},
                                    },
                                },
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The exact text committed as ``crds/epddeployments.easerve.io.yaml``."""
    header = "# Generated by `easerve crd` from the pydantic models. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


CRD_FILENAME = f"{PLURAL}.{GROUP}.yaml"
