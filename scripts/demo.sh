#!/usr/bin/env bash
# Sets up .venv with what the demo needs (jhooks and optax, no PyTorch) and runs the demo:
# a jitted optax training step of a small CNN with hooks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/python examples/demo.py "$@"
