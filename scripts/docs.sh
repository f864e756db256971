#!/usr/bin/env bash
# Sets up .venv-docs with jhooks and the `docs` extra only (no test packages) and builds the
# documentation site strictly into .site/, executing every notebook; runs no test.
#
#   bash scripts/docs.sh            # build (fails on any warning: mkdocs.yml sets strict)
#   bash scripts/docs.sh --serve    # serve at http://127.0.0.1:8000, rebuilding on changes
#
# Its own environment, so that the `docs` extra is shown to be enough by itself (the test
# command's .venv has the `test` extra too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --venv .venv-docs docs
# Material 9.7+ prints an end-of-life banner at every build; the `docs` extra pins 9.6.
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = "--serve" ]; then
  shift
  exec .venv-docs/bin/mkdocs serve --strict "$@"
fi
exec .venv-docs/bin/mkdocs build --strict -d .site "$@"
