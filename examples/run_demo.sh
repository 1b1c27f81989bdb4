#!/usr/bin/env bash
# The main job for now: sets everything up (venv, dependencies, build) and runs the
# end-to-end C API demo on the CPU. The PyTorch adapter will replace it with the quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup_env.sh
python examples/demo_c_api.py "$@"
