#!/usr/bin/env bash
# The main job: sets everything up (venv, dependencies, build) and trains the small GPT of
# examples/quickstart.py in high precision and in FP8 (CPU by default, the GPU when present),
# printing a progress bar and a results table and saving examples/out/quickstart_loss.png.
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/setup_env.sh
python examples/quickstart.py "$@"
