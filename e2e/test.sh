#!/bin/bash
# The whole test suite, exactly as CI runs it (.ci/run calls this script).
# Sets the machine up first (idempotent), then: lint, import contracts, types of the pure core,
# CRD drift, and pytest (unit, property, integration against a real local control plane).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
CACHE=${EASERVE_CACHE:-$HOME/.cache/easerve}
bash "$HERE/bootstrap.sh"
export PATH="$CACHE/venv/bin:$PATH"
cd "$REPO"
unset KUBECONFIG  # the suite starts its own private control plane
echo "== ruff"; ruff check .
echo "== import contracts"; lint-imports
echo "== mypy (pure core)"
mypy runtime/easerve_runtime/api runtime/easerve_runtime/policies runtime/easerve_runtime/profiles \
  runtime/easerve_runtime/topology.py \
  operator/easerve_operator/api operator/easerve_operator/render operator/easerve_operator/reconcile/status.py \
  operator/easerve_operator/reconcile/drift.py operator/easerve_operator/reconcile/loop.py \
  operator/easerve_operator/tuning/stage1.py operator/easerve_operator/tuning/stage2.py \
  operator/easerve_operator/tuning/space.py operator/easerve_operator/tuning/adapt.py \
  operator/easerve_operator/tuning/prometheus.py operator/easerve_operator/reconcile/effective.py
echo "== CRD in sync with the models"
easerve crd | diff -u crds/epddeployments.easerve.io.yaml - || {
  echo "crds/ is stale: run 'easerve crd > crds/epddeployments.easerve.io.yaml'" >&2; exit 1; }
echo "== pytest"
python -m pytest -p no:cacheprovider -q "$@"
