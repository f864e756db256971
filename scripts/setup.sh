#!/usr/bin/env bash
# Creates a virtual environment (if missing) and installs jhooks into it, editable, with the
# given extras. Fails as soon as an install fails.
#
#   bash scripts/setup.sh [EXTRAS]                 # .venv, the newest JAX pyproject allows
#   bash scripts/setup.sh --jax min [EXTRAS]       # .venv-jaxmin, the oldest JAX pyproject allows
#   bash scripts/setup.sh --venv DIR [EXTRAS]      # DIR instead of .venv (scripts/docs.sh: .venv-docs)
#
# EXTRAS is a comma-separated list of pyproject extras, e.g. "test,docs,dev".
set -euo pipefail
cd "$(dirname "$0")/.."

jax=latest
venv_dir=
while [ $# -gt 0 ]; do
  case "$1" in
    --jax) jax="${2:?--jax needs min or latest}"; shift 2 ;;
    --venv) venv_dir="${2:?--venv needs a directory}"; shift 2 ;;
    *) break ;;
  esac
done
extras="${1:-}"

case "$jax" in
  latest)
    venv=.venv
    pins=()
    ;;
  min)
    venv=.venv-jaxmin
    # jax and jaxlib pinned to the lower bounds of pyproject's dependencies ("jax>=0.10"
    # gives jax==0.10), so that raising a bound moves this environment with it.
    mapfile -t pins < <(python3 scripts/jax_lower_bounds.py)
    ;;
  *)
    echo "error: --jax must be min or latest, not '$jax'" >&2
    exit 2
    ;;
esac
venv="${venv_dir:-$venv}"

pip_quietly() {
  # pip's own warning about this machine's index configuration is noise; anything else shows.
  "$venv/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  pip_quietly install -q --upgrade pip
fi
pip_quietly install -q -e ".${extras:+[$extras]}" "${pins[@]}"
"$venv/bin/python" -c "import jhooks" >/dev/null
