#!/bin/bash
# One-time (and idempotent) set-up of a fresh Debian bookworm machine, as root, for EAServe:
# Debian packages, a Python venv with the project and its dev tools, the Kubernetes control plane
# built from Debian's source package, and helm/kubectl. Everything built is cached outside the
# clone in $EASERVE_CACHE (default ~/.cache/easerve) and rebuilt only when missing.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
VENV=$CACHE/venv
say() { printf '[bootstrap] %s\n' "$*" >&2; }

say "Debian packages (etcd, prometheus, Go toolchain, kubernetes source deps)"
bash "$HERE/setup-host.sh"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
stamp=$VENV/.easerve-installed
want=$(sha256sum "$REPO/pyproject.toml" | cut -c1-16):$REPO
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing easerve and its dev tools into $VENV"
  "$VENV/bin/pip" install -q -e "$REPO[dev]"
  echo "$want" > "$stamp"
fi

say "Kubernetes control plane binaries (built once from Debian's source package, ~4 min on 2 cores)"
bash "$HERE/build-k8s.sh"
say "helm and kubectl"
bash "$HERE/get-helm.sh" >/dev/null
say "ready: $VENV/bin/easerve"
