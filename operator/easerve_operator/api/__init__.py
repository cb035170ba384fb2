"""The EPDDeployment API: spec models (shared with the runtime), status models, CRD generation."""

from easerve_runtime.config import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    EPDDeploymentSpec,
    RuntimeConfig,
    SpecError,
    load_manifest,
    parse_spec,
    spec_errors,
)

from easerve_operator.api.status import Condition, EffectiveConfig, EPDDeploymentStatus, Phase, Reason

__all__ = [
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "EPDDeploymentSpec",
    "RuntimeConfig",
    "SpecError",
    "load_manifest",
    "parse_spec",
    "spec_errors",
    "Condition",
    "EffectiveConfig",
    "EPDDeploymentStatus",
    "Phase",
    "Reason",
]
