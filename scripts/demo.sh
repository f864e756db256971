#!/usr/bin/env bash
# Sets up .venv and runs the demo: a jitted optax training step with hooks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python examples/demo.py "$@"
