#!/usr/bin/env bash
# Runs every test on this machine after doing all set-up itself (venv, dependencies,
# build): the C ABI checks (ctest) and the Python suites under tests/ (GPU-marked tests
# are skipped here; tests/gpu/run_on_device.sh runs them on a GPU machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup_env.sh
echo "[tests] C ABI checks and C example (ctest)"
ctest --test-dir build/cmake --output-on-failure
echo "[tests] Python suites"
python -m pytest tests -q -m "not gpu" "$@"
