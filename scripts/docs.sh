#!/usr/bin/env bash
# Sets up .venv-docs with jhooks and the `docs` extra only (no test packages) and builds the
# documentation site strictly into .site/, executing every notebook; runs no test.
#
#   bash scripts/docs.sh            # build (fails on any warning: mkdocs.yml sets strict)
#   bash scripts/docs.sh --serve    # serve at http://127.0.0.1:8000, rebuilding on changes
#
# Its own environment, so that the `docs` extra is shown to be enough by itself (the test
# command's .venv has the `test` extra too).
#
# Executed notebooks are reused: a notebook whose source, the repository's Python sources
# (jhooks/, benchmarks/, the examples' shared modules) and installed packages did not change
# since the last build is not executed again, its page comes from .cache/notebooks/
# (scripts/mkdocs/hooks.py). The first build executes every notebook; later builds only the
# notebooks whose inputs changed. `JHOOKS_DOCS_CACHE=0 bash scripts/docs.sh` executes every
# notebook, as CI (`CI=true`) and the test suite's build (tests/test_docs.py) always do.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --venv .venv-docs docs
# Material 9.7+ prints an end-of-life banner at every build; the `docs` extra pins 9.6.
export NO_MKDOCS_2_WARNING=1
export JHOOKS_DOCS_CACHE="${JHOOKS_DOCS_CACHE:-1}"
if [ "${1:-}" = "--serve" ]; then
  shift
  exec .venv-docs/bin/mkdocs serve --strict "$@"
fi
exec .venv-docs/bin/mkdocs build --strict -d .site "$@"
