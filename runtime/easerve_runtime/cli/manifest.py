"""Loading a command's manifest: one place for the error a user sees when the file is bad.

An invalid spec is refused with one ``spec.a.b: message`` line per field (``api.spec_errors``),
the same wording the webhook and ``easerve sim`` use, not pydantic's multi-line dump.
"""

from __future__ import annotations

import sys

from easerve_runtime.api import EPDDeploymentSpec


def load_spec(path: str, prog: str) -> EPDDeploymentSpec | None:
    """The spec of the manifest at ``path``, or None after printing ``prog: path: why`` to stderr."""
    from pydantic import ValidationError

    from easerve_runtime.api import load_manifest, spec_errors

    try:
        return load_manifest(path)[1]
    except ValidationError as exc:
        print(f"{prog}: {path}: invalid spec: " + "; ".join(spec_errors(exc)), file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"{prog}: {path}: {exc}", file=sys.stderr)
    return None
