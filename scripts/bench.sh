#!/usr/bin/env bash
# Sets up .venv and runs every benchmark: prints the tables, writes
# benchmarks/results/<backend>.json and .md. Pass --quick for a short smoke run, --strict to
# fail (exit status 1) when a target is missed; `--help` lists the options.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m benchmarks.run "$@"
