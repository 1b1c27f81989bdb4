#!/usr/bin/env bash
# Developer build without pip: configure + build into a private build dir and stage an
# importable package. Usage: tests/dev_build.sh NAME  ->  prints the PYTHONPATH to use.
# Several developers (or agents) can build side by side with different NAMEs.
set -euo pipefail
name=${1:-dev}
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
build=/tmp/nvte_build_$name
stage=/tmp/nvte_pkg_$name
pybind_dir=$($py -c 'import pybind11; print(pybind11.get_cmake_dir())')
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$root" -B "$build" "${gen[@]}" -DNVTE_BUILD_PYTHON=ON -DCMAKE_BUILD_TYPE=Release \
  -DNVTE_WITH_CUDA="${NVTE_WITH_CUDA:-auto}" -DNVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS:-80;89;90}" -DPython_EXECUTABLE="$(command -v $py)" \
  -Dpybind11_DIR="$pybind_dir" >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "${NVTE_BUILD_JOBS:-2}" >&2
rm -rf "$stage" && mkdir -p "$stage"
cp -r "$root/bindings/python/transformer_engine" "$stage/"
for fw in pytorch jax paddle; do
  [ -d "$root/bindings/$fw/transformer_engine/$fw" ] && cp -r "$root/bindings/$fw/transformer_engine/$fw" "$stage/transformer_engine/"
done
cp -P "$build"/libtransformer_engine.so* "$build"/_nvte*.so "$stage/transformer_engine/"
cp -r "$root/include" "$stage/transformer_engine/include"
echo "$stage"
