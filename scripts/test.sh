#!/usr/bin/env bash
# Sets up the environments, runs the checks reviewers run, then the test suite.
#
#   bash scripts/test.sh                   # checks, then the tests on the newest and the oldest JAX
#   bash scripts/test.sh --jax latest      # checks, then the tests on the newest JAX only
#   bash scripts/test.sh --jax min         # checks, then the library tests on the oldest JAX only
#   bash scripts/test.sh -- -k sharded     # anything after the options goes to pytest
#
# 1. Checks, each of which fails the run: `ruff check`, `ruff format --check` (sources and
#    notebooks), `pyright` (jhooks/ and tests/typed_usage.py, configured in pyproject.toml).
# 2. Newest JAX (.venv): the whole suite, which also executes every notebook and builds the
#    docs site strictly, executing the notebooks in it (tests/test_docs.py).
# 3. Oldest JAX that pyproject allows (.venv-jaxmin, jax and jaxlib pinned to the lower bounds):
#    the library tests, without the notebook, docs and benchmark tests, which test no more of
#    jhooks and cost most of the time.
set -uo pipefail
cd "$(dirname "$0")/.."

jax=both
while [ $# -gt 0 ]; do
  case "$1" in
    --jax) jax="${2:?--jax needs min, latest or both}"; shift 2 ;;
    --jax=*) jax="${1#--jax=}"; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
case "$jax" in
  min | latest | both) ;;
  *) echo "error: --jax must be min, latest or both, not '$jax'" >&2; exit 2 ;;
esac

step() { echo; echo "== $*"; }

run_pytest() {
  # pytest's exit status 5 means that it collected no test: a run that tested nothing fails.
  # Two workers (pytest-xdist): the suite runs in about half the time on CI's 2 cores.
  local python="$1"
  shift
  "$python" -m pytest -n "${JHOOKS_TEST_WORKERS:-2}" "$@"
  local status=$?
  if [ $status -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    return 1
  fi
  return $status
}

step "setting up .venv (newest JAX)"
bash scripts/setup.sh test,docs,dev || exit 1

step "ruff check"
.venv/bin/ruff check . || exit 1
step "ruff format --check"
.venv/bin/ruff format --check . || exit 1
step "pyright"
.venv/bin/pyright || exit 1

if [ "$jax" = latest ] || [ "$jax" = both ]; then
  step "tests on $(.venv/bin/python -c 'import jax; print("jax", jax.__version__)')"
  run_pytest .venv/bin/python "$@" || exit 1
fi

if [ "$jax" = min ] || [ "$jax" = both ]; then
  step "setting up .venv-jaxmin (oldest JAX that pyproject.toml allows)"
  bash scripts/setup.sh --jax min test || exit 1
  step "library tests on $(.venv-jaxmin/bin/python -c 'import jax; print("jax", jax.__version__)')"
  # Without the notebooks, docs and benchmarks (no more of jhooks, most of the time), the
  # property tests (the same code paths as the parity tests, many times over) and the
  # pyright test (types do not depend on JAX's version), the peers' suites and the Flax NNX
  # tests (the same mechanisms as the parity tests, through other front doors).
  run_pytest .venv-jaxmin/bin/python \
    --ignore=tests/test_notebooks.py --ignore=tests/test_docs.py \
    --ignore=tests/test_benchmarks.py --ignore=tests/test_properties.py \
    --ignore=tests/test_runs_properties.py --ignore=tests/peers --ignore-glob='tests/test_nnx*.py' \
    --deselect tests/test_modules_api.py::test_typed_usage_passes_pyright "$@" || exit 1
fi
