#!/bin/bash
# Kubernetes 1.20 JSON schemas for validating rendered manifests offline. The installed
# `kubernetes-validate` only ships recent versions (1.25+); its 1.28.0 release still carries 1.20.
# This extracts just that version's strict schemas from the PyPI wheel into
#   $EASERVE_CACHE/k8s-schemas/v1.20.0-local-strict   (default EASERVE_CACHE=~/.cache/easerve)
# Idempotent. Prints the directory.
set -euo pipefail
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
VER=${K8S_SCHEMA_VERSION:-1.20.0}
DEST=$CACHE/k8s-schemas/v$VER-local-strict
if [ -f "$DEST/deployment-apps-v1.json" ]; then echo "$DEST"; exit 0; fi
if [ -x "$CACHE/venv/bin/pip" ]; then PIP=("$CACHE/venv/bin/pip"); else PIP=(python3 -m pip); fi
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
"${PIP[@]}" download -q --no-deps --disable-pip-version-check -d "$T" "kubernetes-validate==1.28.0" 2>/dev/null
python3 - "$T"/kubernetes_validate-1.28.0-py3-none-any.whl "v$VER-local-strict" "$DEST" <<'PY'
import os, sys, zipfile
whl, sub, dest = sys.argv[1:]
prefix = f"kubernetes_validate/kubernetes-json-schema/{sub}/"
tmp = dest + ".tmp"
os.makedirs(tmp, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            with open(os.path.join(tmp, n[len(prefix):]), "wb") as f:
                f.write(z.read(n))
os.replace(tmp, dest)
PY
echo "$DEST"
