#!/usr/bin/env bash
# Creates .venv (if missing) and installs jhooks with the given extras into it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
.venv/bin/pip install -q -e ".${extras:+[$extras]}" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import jhooks" >/dev/null
