#!/usr/bin/env bash
# Shared set-up of the README commands and CI: a virtual environment with every
# dependency, then a build + install of this repository into it. Idempotent and
# incremental (the CMake build directory build/cmake is reused).
# Source it: `source .ci/setup_env.sh`. Honours NVTE_VENV, NVTE_FRAMEWORK, NVTE_WITH_CUDA.
set -euo pipefail
NVTE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NVTE_VENV=${NVTE_VENV:-$NVTE_ROOT/.venv}
cd "$NVTE_ROOT"

if [ ! -x "$NVTE_VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $NVTE_VENV"
  python3 -m venv "$NVTE_VENV"
fi
# shellcheck disable=SC1091
source "$NVTE_VENV/bin/activate"

pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
if ! python -c "import numpy, ml_dtypes, pytest, pybind11, cmake, ninja, setuptools" 2>/dev/null; then
  echo "[setup] installing build and test dependencies"
  pip_q "setuptools>=68" wheel "cmake>=3.24" ninja "pybind11>=2.12" numpy "ml_dtypes>=0.5" pytest
fi
# The CUDA backend is compiled wherever nvcc exists (CI too); its cuBLASLt header comes from
# the nvidia-cublas wheel matching CUDA 13.0 (the library itself opens cuBLASLt at run time).
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && [ "${NVTE_WITH_CUDA:-auto}" != OFF ] \
   && ! python -c "import nvidia.cu13, os, sys; sys.exit(not os.path.exists(os.path.join(nvidia.cu13.__path__[0], 'include', 'cublasLt.h')))" 2>/dev/null; then
  echo "[setup] installing nvidia-cublas (cuBLASLt header for the CUDA backend)"
  pip_q "nvidia-cublas==13.0.2.14"
fi
# cuDNN fused attention (core/cuda/cudnn/) compiles against cudnn.h (nvidia-cudnn-cu13, the
# 9.19 that PyTorch's CUDA 13 builds load), the header-only cuDNN frontend (no deps: its Python
# extras are not needed) and nvrtc.h, which the frontend includes (nvidia-cuda-nvrtc).
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } && [ "${NVTE_WITH_CUDA:-auto}" != OFF ] \
   && ! python -c "import nvidia.cudnn, os, sys, sysconfig; p = sysconfig.get_paths()['purelib']; sys.exit(not (os.path.exists(os.path.join(p, 'include', 'cudnn_frontend.h')) and os.path.exists(os.path.join(p, 'nvidia', 'cu13', 'include', 'nvrtc.h'))))" 2>/dev/null; then
  echo "[setup] installing nvidia-cudnn-cu13, nvidia-cudnn-frontend, nvidia-cuda-nvrtc (cuDNN attention headers)"
  pip_q --no-deps "nvidia-cudnn-cu13==9.19.1.2" "nvidia-cudnn-frontend==1.32.0" "nvidia-cuda-nvrtc==13.0.88"
fi
# PyTorch: its CPU wheel (torch==2.13.0 is a local file on the CPU machines); a GPU machine keeps its own.
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  pip_q "torch==2.13.0"
fi

# The quickstart's progress bar and loss-curve plot.
if ! python -c "import matplotlib, tqdm" 2>/dev/null; then
  echo "[setup] installing matplotlib and tqdm (quickstart)"
  pip_q matplotlib tqdm
fi

echo "[setup] building and installing transformer_engine (NVTE_FRAMEWORK=${NVTE_FRAMEWORK-<installed>})"
pip_q --no-build-isolation --no-deps "$NVTE_ROOT"
python -c "import transformer_engine as te; print('[setup] transformer_engine', te.__version__, 'from', te.__file__)"
