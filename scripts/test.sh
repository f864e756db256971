#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite, then builds the docs strictly.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,docs || exit 1
.venv/bin/python -m pytest "$@"
status=$?
if [ $status -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
[ $status -eq 0 ] || exit $status
if [ -f mkdocs.yml ]; then
  NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d .site || exit 1
fi
