"""Cross-field rules of the spec that an OpenAPI schema cannot express.

Each rule names the field to fix by its full wire path (``spec.offload.ratio``), so the
admission webhook, the reconciler and the CLI report the same message verbatim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from easerve_runtime.api.spec import Backend, DeploymentMode, LocalPrefillProcess, Modality, PartitionMode

if TYPE_CHECKING:
    from easerve_runtime.api.spec import EPDDeploymentSpec


class SpecError(ValueError):
    """A cross-field rule failed; ``path`` is the wire path of the field to fix."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def cross_field_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    """Rules the schema cannot express. Each names its field by wire path."""
    errs: list[SpecError] = []
    a = spec.allocation
    e = spec.engine
    sources = {
        "spec.engine.profile": e.profile,
        "spec.engine.profileFile": e.profile_file,
        "spec.engine.profileConfigMap": e.profile_config_map,
    }
    given = [k for k, v in sources.items() if v is not None]
    if len(given) != 1:
        errs.append(
            SpecError(
                "spec.engine",
                "give exactly one latency profile source: spec.engine.profile (a shipped name), "
                "spec.engine.profileFile (a path) or spec.engine.profileConfigMap (a ConfigMap); "
                f"got {', '.join(given) if given else 'none'}",
            )
        )
    errs += model_volume_errors(spec)
    tier_names = [t.name for t in spec.slo.tiers]
    if len(set(tier_names)) != len(tier_names):
        errs.append(SpecError("spec.slo.tiers", f"tier names must be unique, got {tier_names}"))
    if spec.slo.objective not in tier_names:
        errs.append(SpecError("spec.slo.objective", f"'{spec.slo.objective}' is not a tier in spec.slo.tiers {tier_names}"))
    if spec.tuning.objective.startswith("goodput@"):
        tier = spec.tuning.objective.split("@", 1)[1]
        if tier not in tier_names:
            errs.append(SpecError("spec.tuning.objective", f"tier '{tier}' is not in spec.slo.tiers {tier_names}"))
    lim = spec.limits
    if lim.max_prompt_tokens >= lim.max_context_tokens:
        errs.append(
            SpecError(
                "spec.limits.maxPromptTokens",
                f"({lim.max_prompt_tokens}) must be below spec.limits.maxContextTokens ({lim.max_context_tokens})",
            )
        )
    if lim.max_output_tokens >= lim.max_context_tokens:
        errs.append(
            SpecError(
                "spec.limits.maxOutputTokens",
                f"({lim.max_output_tokens}) must be below spec.limits.maxContextTokens ({lim.max_context_tokens})",
            )
        )
    if spec.tuning.enabled and spec.tuning.target_rate is None:
        errs.append(SpecError("spec.tuning.targetRate", "is required when spec.tuning.enabled is true"))
    if spec.mode == DeploymentMode.OMNI_COLOCATED:
        if spec.omni is None:
            errs.append(SpecError("spec.omni", "is required when spec.mode is omni-colocated"))
        if spec.model.modality != Modality.OMNI:
            errs.append(SpecError("spec.model.modality", "must be omni when spec.mode is omni-colocated"))
        if spec.omni is not None and spec.omni.n_min > spec.omni.n_max:
            errs.append(SpecError("spec.omni.nMin", f"({spec.omni.n_min}) must not exceed spec.omni.nMax ({spec.omni.n_max})"))
        return errs
    if spec.omni is not None:
        errs.append(SpecError("spec.omni", "is only valid when spec.mode is omni-colocated"))
    if spec.mode == DeploymentMode.AGGREGATED:
        return errs + aggregated_errors(spec) + engine_errors(spec)
    if spec.aggregated is not None:
        errs.append(SpecError("spec.aggregated", "is only valid when spec.mode is aggregated"))
    if a.encode.tensor_parallel != 1:
        errs.append(SpecError("spec.allocation.encode.tensorParallel", "encode workers use one GPU each (must be 1)"))
    if a.decode.replicas < 1:
        errs.append(SpecError("spec.allocation.decode.replicas", "at least one decode worker is required"))
    if a.encode.replicas < 1:
        errs.append(SpecError("spec.allocation.encode.replicas", "at least one encode worker is required"))
    if a.gpus > spec.gpu_budget and "allocation" not in spec.model_fields_set and spec.gpu_budget < 2:
        errs.append(
            SpecError(
                "spec.gpuBudget",
                f"is {spec.gpu_budget}: the E/P/D pools need at least 2 GPUs (encode with local prefill, decode); "
                "on one GPU use spec.mode: aggregated",
            )
        )
    elif a.gpus > spec.gpu_budget:
        errs.append(
            SpecError(
                "spec.allocation",
                f"needs {a.gpus} GPUs ({a.label()}), more than spec.gpuBudget={spec.gpu_budget}",
            )
        )
    s = spec.offload.ratio
    if tuning_chooses(spec, "offload", "ratio"):
        # s is left to HAS (spec.tuning.enabled, offload.ratio unset): the rules that read s run on
        # the resolved spec, once the tuned value fills it in (operator: reconcile.effective)
        return errs + engine_errors(spec) + _static_errors(spec)
    if s > 0 and a.prefill.replicas < 1:
        errs.append(
            SpecError("spec.offload.ratio", f"is {s} but spec.allocation.prefill.replicas is 0: nothing to offload to")
        )
    if s < 1 and a.encode.replicas < 1:
        errs.append(SpecError("spec.offload.ratio", f"is {s} (< 1) but there are no encode GPUs to host local prefill"))
    if spec.sm_partition.mode != PartitionMode.NONE and s >= 1:
        errs.append(
            SpecError(
                "spec.smPartition.mode",
                f"is {spec.sm_partition.mode} but spec.offload.ratio is 1: no local prefill shares the encode GPU",
            )
        )
    return errs + _static_errors(spec) + _local_prefill_errors(spec) + engine_errors(spec)


AGGREGATED_IGNORES = {
    "allocation": "spec.allocation",
    "offload": "spec.offload",
    "sm_partition": "spec.smPartition",
    "encode": "spec.encode",
    "prefill": "spec.prefill",
}
"""Sections of the disaggregated pipeline that an aggregated deployment has no use for."""


def aggregated_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    """``spec.mode: aggregated``: one engine per ``spec.aggregated.tensorParallel`` GPUs. The E/P/D
    sections would be silently ignored, so a value other than their default is refused, naming it
    (``spec.decode`` applies: the aggregated worker admits by its maxSequences and kvMemoryFraction)."""
    errs: list[SpecError] = []
    for attr, path in AGGREGATED_IGNORES.items():
        value = getattr(spec, attr)
        if value != type(value)():
            hint = " (the token budget is spec.aggregated.tokenBudget)" if attr == "prefill" else ""
            errs.append(
                SpecError(path, f"does not apply when spec.mode is aggregated{hint}: remove it or use another mode")
            )
    if spec.tuning.enabled:
        errs.append(SpecError("spec.tuning.enabled", "HAS tunes the disaggregated pipeline; not in aggregated mode"))
    agg = spec.aggregated_engine
    tp = agg.tensor_parallel
    if spec.gpu_budget % tp:
        errs.append(
            SpecError("spec.gpuBudget", f"({spec.gpu_budget}) must be a multiple of spec.aggregated.tensorParallel ({tp})")
        )
    if spec.engine.backend == Backend.TORCH and tp != 1:
        errs.append(
            SpecError(
                "spec.aggregated.tensorParallel",
                f"is {tp}, but the torch engine runs TP 1 per worker (tensor parallel is not built yet)",
            )
        )
    return errs


def _local_prefill_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    if (spec.sm_partition.local_prefill == LocalPrefillProcess.IN_ENCODE_PROCESS
            and spec.engine.backend != Backend.TORCH):
        return [SpecError("spec.smPartition.localPrefill",
                          "in-encode-process needs spec.engine.backend: torch (the sim engine shares no device)")]
    return []


def _static_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    if spec.sm_partition.mode == PartitionMode.STATIC and spec.sm_partition.static_encode_sms is None:
        return [SpecError("spec.smPartition.staticEncodeSms", "is required when spec.smPartition.mode is static")]
    return []


def tuning_chooses(spec: EPDDeploymentSpec, *path: str) -> bool:
    """Whether HAS fills the field at ``path`` (snake_case): tuning is on and the spec leaves it unset."""
    if not spec.tuning.enabled:
        return False
    obj: Any = spec
    for p in path:
        if p not in obj.model_fields_set:
            return True
        obj = getattr(obj, p)
    return False


def engine_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    """What the real engines cannot serve yet, refused at admission rather than at worker start."""
    errs: list[SpecError] = []
    backend = spec.engine.backend
    if backend == Backend.VLLM:
        errs.append(SpecError("spec.engine.backend", "vllm is not supported yet (no adapter); use torch or sim"))
    if backend != Backend.TORCH:
        return errs
    a = spec.allocation
    for stage, alloc in (("prefill", a.prefill), ("decode", a.decode)):
        if alloc.tensor_parallel != 1:
            errs.append(
                SpecError(
                    f"spec.allocation.{stage}.tensorParallel",
                    f"is {alloc.tensor_parallel}, but the torch engine runs TP 1 per worker (tensor parallel is not built yet)",
                )
            )
    if spec.model.path is None:
        errs.append(SpecError("spec.model.path", "is required when spec.engine.backend is torch (a model directory)"))
    return errs


def model_volume_errors(spec: EPDDeploymentSpec) -> list[SpecError]:
    """``spec.model.volume``: exactly one source, and ``spec.model.path`` inside its mount."""
    v = spec.model.volume
    if v is None:
        return []
    errs: list[SpecError] = []
    given = [k for k, x in (("persistentVolumeClaim", v.persistent_volume_claim), ("hostPath", v.host_path)) if x]
    if len(given) != 1:
        errs.append(
            SpecError(
                "spec.model.volume",
                "give exactly one of spec.model.volume.persistentVolumeClaim and spec.model.volume.hostPath; "
                f"got {', '.join(given) if given else 'none'}",
            )
        )
    mount = v.mount_path.rstrip("/")
    path = spec.model.path
    if path is None:
        errs.append(SpecError("spec.model.path", f"is required with spec.model.volume (a directory under {mount})"))
    elif not (path.rstrip("/") + "/").startswith(mount + "/"):
        errs.append(
            SpecError("spec.model.path", f"'{path}' is not under spec.model.volume.mountPath '{v.mount_path}'")
        )
    return errs


LABEL_VALUE_MAX = 63
"""Kubernetes caps label values at 63 characters; every child carries ``metadata.name`` as a label."""


def name_errors(name: str) -> list[str]:
    """Rules on ``metadata.name`` that the children's labels impose (the API server admits 253 chars).

    Every child is labelled ``easerve.io/deployment: <metadata.name>`` (selectors, the capacity
    check and GitOps grouping rely on it), so a longer name could never be applied: refuse it
    up front, naming the field, instead of letting every child fail with an opaque 422.
    """
    if len(name) > LABEL_VALUE_MAX:
        return [
            f"metadata.name: is {len(name)} characters; at most {LABEL_VALUE_MAX} are allowed, because every "
            f"child carries it as a label value (easerve.io/deployment)"
        ]
    return []


def spec_errors(exc: ValidationError, prefix: str = "spec") -> list[str]:
    """Format a pydantic error as ``spec.a.b: message`` lines naming each field by wire path."""
    out: list[str] = []
    for e in exc.errors():
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, SpecError):
            out.append(str(ctx_err))
            continue
        loc = ".".join([prefix] + [str(p) for p in e["loc"]])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append(f"{loc}: {msg}")
    return out


