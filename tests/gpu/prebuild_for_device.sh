#!/usr/bin/env bash
# On the CPU machine: build the package that tests/gpu/run_on_device.sh's `prebuilt` step uses,
# so that device minutes go to tests and benchmarks rather than to compiling (the cuDNN frontend
# translation unit alone takes minutes). libtransformer_engine.so links cudart statically and
# opens cuBLASLt/cuDNN at run time, so it runs on the GPU machine as built here; the _nvte module
# is built for that machine's Python (3.12, PY312 below). Result: .prebuilt/transformer_engine
# (git-ignored; name .prebuilt in the device call's carry) and .prebuilt/COMMIT.
#   tests/gpu/prebuild_for_device.sh          (NVTE_CUDA_ARCHS default 90, build dir /tmp/nvte_build_dev312)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  for c in /root/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    [ -x "$c" ] && { PY312=$c; break; }
  done
fi
[ -n "$PY312" ] || { echo "prebuild: no python3.12 found (set PY312)"; exit 1; }
venv=${PREBUILD_VENV:-/tmp/py312}
[ -x "$venv/bin/python" ] || "$PY312" -m venv "$venv"
"$venv/bin/python" -c "import pybind11" 2>/dev/null || "$venv/bin/python" -m pip install -q pybind11
# Headers of cuBLASLt / cuDNN / the cuDNN frontend: those the CI set-up installed in .venv.
sp=$(ls -d "$root"/.venv/lib/python3*/site-packages | head -1)
export NVTE_CUBLASLT_INCLUDE_DIR=$sp/nvidia/cu13/include NVTE_CUDNN_INCLUDE_DIR=$sp/nvidia/cudnn/include \
  NVTE_CUDNN_FRONTEND_INCLUDE_DIR=$sp/include
for h in "$NVTE_CUBLASLT_INCLUDE_DIR/cublasLt.h" "$NVTE_CUDNN_INCLUDE_DIR/cudnn.h" "$NVTE_CUDNN_FRONTEND_INCLUDE_DIR/cudnn_frontend.h"; do
  [ -f "$h" ] || { echo "prebuild: $h missing (run .ci/setup_env.sh first)"; exit 1; }
done
export PATH=$root/.venv/bin:/usr/local/cuda/bin:$PATH
stage=$(PYTHON=$venv/bin/python NVTE_WITH_CUDA=ON NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} \
        NVTE_BUILD_JOBS=${NVTE_BUILD_JOBS:-2} tests/dev_build.sh dev312)
grep -q "cuDNN fused attention ON" /tmp/nvte_build_dev312.configure.log \
  || { echo "prebuild: configured without cuDNN attention"; exit 1; }
rm -rf .prebuilt && mkdir -p .prebuilt
cp -r "$stage/transformer_engine" .prebuilt/
strip --strip-debug .prebuilt/transformer_engine/*.so* 2>/dev/null || true
{ git rev-parse --short HEAD; git status --porcelain | grep -q . && echo "(+ uncommitted changes)" || true; } \
  | tr '\n' ' ' > .prebuilt/COMMIT
du -sh .prebuilt
