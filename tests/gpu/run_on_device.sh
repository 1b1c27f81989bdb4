#!/usr/bin/env bash
# On the lent GPU machine: build the library with the CUDA backend, run the GPU test suite
# (CUDA vs the CPU oracle), compute-sanitizer memcheck over it, and the GPU benchmarks.
# Logs and a results table go to $OUT (default /tmp/nvte_out).
#   tests/gpu/run_on_device.sh [build|prebuilt] [test] [sanitize] [bench] [profile] [pytorch] [acceptance]
#                              [tutorial] [quickstart] [host] [cpu] [gemmlog] [memcheck_all] [candidates] [ab]
#                              [kvdecode] [cp] [wgrad] [pack]
#                              (default: build test bench)
# prebuilt: use the package staged by tests/gpu/prebuild_for_device.sh on the CPU machine
# (.prebuilt/transformer_engine, carried: libtransformer_engine.so for sm_90 with static cudart
# and the _nvte module for Python 3.12) instead of building here (saves the device minutes of
# the cuDNN frontend compile).
# pytorch: tests/pytorch with NVTE_TEST_DEVICE=cuda; acceptance: the shared seed scripts, from
# .acceptance/ (a carried copy of ../shared/acceptance) or ../shared/acceptance; tutorial: the
# tutorial-layer benchmark (torchao from carried wheels in .whl/ when present).
# profile: Nsight Compute over one call of each memory-bound kernel (clocks left alone).
# quickstart: the main job on the GPU (examples/quickstart.py, 300 steps, its GPU sizes; one run
# per seed in QUICKSTART_SEEDS, default 0; QUICKSTART_ARGS adds options, QUICKSTART_TAG names the
# logs). host: benchmarks/host_overhead.py --device cuda (host time per module call).
# kvdecode: benchmarks/gpu_kv_cache_decode.py (a decode step through DotProductAttention +
# InferenceParams against torch's own cache; $OUT/kv_decode.log; KVDECODE_ARGS, KVDECODE_BASE below).
# SANITIZE_TESTS / PYTORCH_TESTS: the test paths for sanitize / pytorch; GPU_TESTS: the test
# paths for test (default tests/gpu); GPU_TEST_ARGS: extra pytest arguments for test (e.g. -s);
# SANITIZE_ARGS: extra pytest arguments for sanitize.
# Each step prints its wall time.
# gemmlog: benchmarks/gpu_gemm.py on one shape (GEMMLOG_SHAPE, default "4096 16384") under
# cuBLASLt's trace log ($OUT/cublaslt_trace.log).
# memcheck_all: the whole GPU suite (tests/gpu, "large" cases left out) under compute-sanitizer
# memcheck, in parallel shards of test files (one process each; MEMCHECK_TIMEOUT per shard,
# default 540 s, pytest interrupted 30 s before it); logs $OUT/memcheck_<shard>.log.
# candidates: benchmarks/cublaslt_candidates.cu on the benchmark's GEMM shapes (FP8 and BF16):
# cuBLASLt's heuristic candidates, their speed and whether their outputs agree ($OUT/candidates.txt);
# CANDIDATES_KINDS (default "fp8 bf16"), CANDIDATES_NK ("N K" pairs separated by ";", default the
# benchmark's five) and CANDIDATES_TOP (results asked of the heuristic, default 8) narrow or widen it.
# cp: context-parallel attention over this host's GPUs (tests + benchmark; 2+ GPUs: a multi-GPU kind).
# pack: every file under $OUT into one $OUT/logs.tgz (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/nvte_out}
mkdir -p "$OUT"
steps=${*:-build test bench}
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1
# cuDNN frontend headers: the carried wheel's include/ (.cudnnfe/include) when present.
[ -d .cudnnfe/include ] && export NVTE_CUDNN_FRONTEND_INCLUDE_DIR=$PWD/.cudnnfe/include
PY=${PYTHON:-python3}
STAGE=/tmp/nvte_pkg_gpu
rc=0

step_t0=$(date +%s)
took() { echo "[$1: $(( $(date +%s) - step_t0 )) s]"; step_t0=$(date +%s); }

if [[ " $steps " == *" build "* || " $steps " == *" prebuilt "* ]]; then
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -1
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
    git rev-parse --short HEAD 2>/dev/null || true
    [ -f .prebuilt/COMMIT ] && echo "prebuilt from $(cat .prebuilt/COMMIT)"; } | tee "$OUT/env.txt"
fi
if [[ " $steps " == *" prebuilt "* ]]; then
  [ -d .prebuilt/transformer_engine ] || { echo "prebuilt: .prebuilt/transformer_engine missing (carry it)"; exit 1; }
  rm -rf "$STAGE" && mkdir -p "$STAGE" && cp -r .prebuilt/transformer_engine "$STAGE/"
  # the carried Python sources are replaced by this tree's (they may be newer than the build)
  cp -r bindings/python/transformer_engine/. "$STAGE/transformer_engine/"
  for fw in pytorch jax paddle; do
    [ -d "bindings/$fw/transformer_engine/$fw" ] && rm -rf "$STAGE/transformer_engine/$fw" \
      && cp -r "bindings/$fw/transformer_engine/$fw" "$STAGE/transformer_engine/"
  done
  PYTHONPATH=$STAGE $PY -c "from transformer_engine import _nvte; print('prebuilt: _nvte loads')" || exit 1
  took prebuilt
fi
if [[ " $steps " == *" build "* ]]; then
  t0=$(date +%s)
  if PYTHON=$PY NVTE_WITH_CUDA=ON NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} NVTE_BUILD_JOBS=16 \
      tests/dev_build.sh gpu >"$OUT/build.log" 2>&1; then
    echo "build: ok in $(( $(date +%s) - t0 )) s"
  else
    echo "build: FAILED"; tail -40 "$OUT/build.log"; exit 1
  fi
fi
export PYTHONPATH=$STAGE

if [[ " $steps " == *" cpu "* ]]; then
  $PY -m pytest -q -x tests/core -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/cpu_tests.log"
fi

if [[ " $steps " == *" test "* ]]; then
  $PY -m pytest -q ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -rs ${GPU_TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took test
fi

if [[ " $steps " == *" sanitize "* ]]; then
  compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all \
    $PY -m pytest -q -x ${SANITIZE_TESTS:-tests/gpu} -p no:cacheprovider -k "${SANITIZE_K:-not large}" \
    ${SANITIZE_ARGS:-} 2>&1 | tee "$OUT/sanitizer.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took sanitize
fi

if [[ " $steps " == *" memcheck_all "* ]]; then
  declare -A shards=(
    [cast]="tests/gpu/test_cast_gpu.py"
    [act_softmax]="tests/gpu/test_activation_gpu.py tests/gpu/test_softmax_gpu.py tests/gpu/test_attn_softmax_gpu.py tests/gpu/test_dispatch_gpu.py tests/gpu/test_fp8_codec_gpu.py"
    [norm]="tests/gpu/test_normalization_gpu.py"
    [transpose]="tests/gpu/test_transpose_gpu.py"
    [gemm_recipe]="tests/gpu/test_gemm_gpu.py tests/gpu/test_gemm_fp8_gpu.py tests/gpu/test_gemm_epilogue_gpu.py tests/gpu/test_gemm_autotune_gpu.py tests/gpu/test_recipe_gpu.py"
    [attention]="tests/gpu/test_fused_attn_gpu.py"
    [attention_thd]="tests/gpu/test_fused_attn_thd_gpu.py"
    [attention_fp8]="tests/gpu/test_fused_attn_fp8_gpu.py"
    [attention_softmax]="tests/gpu/test_fused_attn_softmax_gpu.py tests/gpu/test_attn_merge_gpu.py"
    [attention_kv_cache]="tests/gpu/test_fused_attn_kv_cache_gpu.py tests/gpu/test_copy_to_kv_cache_gpu.py"
    [rope]="tests/gpu/test_fused_rope_gpu.py")
  # pytest gets SIGINT 30 s before the shard's limit, so a shard cut short still prints its
  # summary (and compute-sanitizer its ERROR SUMMARY) for the tests it ran
  mt=${MEMCHECK_TIMEOUT:-540}
  for name in "${!shards[@]}"; do
    timeout "$mt" compute-sanitizer --tool memcheck --error-exitcode 3 --target-processes all \
      timeout -s INT $((mt - 30)) $PY -m pytest -q ${shards[$name]} -p no:cacheprovider -k "not large" \
      >"$OUT/memcheck_$name.log" 2>&1 &
  done
  wait
  for name in "${!shards[@]}"; do
    summary=$(grep -E "ERROR SUMMARY|passed|failed|error" "$OUT/memcheck_$name.log" | tail -2 | tr '\n' ' ')
    echo "memcheck $name: ${summary:-no summary (timed out?)}"
    grep -q "ERROR SUMMARY: 0 errors" "$OUT/memcheck_$name.log" || rc=1
  done
  took memcheck_all
fi
if [[ " $steps " == *" bench "* ]]; then
  $PY benchmarks/gpu_bench.py --out "$OUT" ${BENCH_ONLY:+--only $BENCH_ONLY} 2>&1 | tee "$OUT/bench.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took bench
fi
if [[ " $steps " == *" gemmlog "* ]]; then
  # cuBLASLt's own trace of one GEMM shape (GEMMLOG_SHAPE="N K", M = 8192), ours and torch's calls:
  # which algorithm (tile, stages, split-K, cluster) each side ran
  CUBLASLT_LOG_LEVEL=2 CUBLASLT_LOG_FILE="$OUT/cublaslt_trace.log" \
    $PY benchmarks/gpu_gemm.py ${GEMMLOG_SHAPE:-4096 16384} 2>&1 | tail -12
  took gemmlog
fi
if [[ " $steps " == *" candidates "* ]]; then
  nvcc -std=c++17 -O2 -arch=sm_90 benchmarks/cublaslt_candidates.cu -lcublasLt -o /tmp/nvte_candidates || rc=1
  IFS=';' read -ra nks <<<"${CANDIDATES_NK:-12288 4096;4096 4096;16384 4096;4096 16384;8192 8192}"
  for kind in ${CANDIDATES_KINDS:-fp8 bf16}; do
    for nk in "${nks[@]}"; do
      /tmp/nvte_candidates $kind 8192 $nk ${CANDIDATES_TOP:-8} >>"$OUT/candidates.txt" 2>&1 || rc=1
    done
  done
  grep -E "^(fp8|bf16) M|ms |differ|fail" "$OUT/candidates.txt" | grep -v " 0 of "
  took candidates
fi
if [[ " $steps " == *" pytorch "* ]]; then
  NVTE_TEST_DEVICE=cuda $PY -m pytest -q ${PYTORCH_TESTS:-tests/pytorch} -p no:cacheprovider -rfs --tb=short 2>&1 \
    | tee "$OUT/pytorch_cuda.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took pytorch
fi
if [[ " $steps " == *" wgrad "* ]]; then
  # wgrad: benchmarks/gpu_wgrad_accumulation.py (fuse_wgrad_accumulation vs .grad + main_grad.add_)
  (cd benchmarks && $PY gpu_wgrad_accumulation.py) 2>&1 | tee "$OUT/wgrad.log" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took wgrad
fi
if [[ " $steps " == *" kvdecode "* ]]; then
  # KVDECODE_ARGS: the benchmark's options (e.g. --diagnose). KVDECODE_BASE: a folder of adapter
  # .py files (bindings/pytorch/.../pytorch/ names) to run the benchmark again with, after this
  # tree's: a before/after on the same machine ($OUT/kv_decode_base.log).
  $PY benchmarks/gpu_kv_cache_decode.py ${KVDECODE_ARGS:-} 2>&1 | tee "$OUT/kv_decode.log" | tail -14
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  if [ -n "${KVDECODE_BASE:-}" ]; then
    rm -rf /tmp/nvte_pkg_base && cp -r "$STAGE" /tmp/nvte_pkg_base \
      && cp "$KVDECODE_BASE"/*.py /tmp/nvte_pkg_base/transformer_engine/pytorch/
    PYTHONPATH=/tmp/nvte_pkg_base $PY benchmarks/gpu_kv_cache_decode.py 2>&1 | tee "$OUT/kv_decode_base.log" \
      | tail -14
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  took kvdecode
fi

if [[ " $steps " == *" cp "* ]]; then
  # context-parallel attention across this host's GPUs (NCCL, one rank per GPU): the CP tests with
  # NVTE_TEST_DEVICE=cuda and benchmarks/gpu_context_parallel.py ($OUT/cp_tests.log, $OUT/cp_bench.log)
  NVTE_TEST_DEVICE=cuda $PY -m pytest -q -x tests/pytorch/test_context_parallel.py -p no:cacheprovider \
    > "$OUT/cp_tests.log" 2>&1; r=$?; tail -5 "$OUT/cp_tests.log"; [ $r = 0 ] || rc=1
  # again with the ring's dK / dV sums travelling in bf16 (NVTE_CP_DKV_FP32=0)
  NVTE_CP_DKV_FP32=0 NVTE_TEST_DEVICE=cuda $PY -m pytest -q -x tests/pytorch/test_context_parallel.py \
    -p no:cacheprovider > "$OUT/cp_tests_bf16_dkv.log" 2>&1; r=$?; tail -2 "$OUT/cp_tests_bf16_dkv.log"; [ $r = 0 ] || rc=1
  $PY benchmarks/gpu_context_parallel.py 2>&1 | tee "$OUT/cp_bench.log" | tail -12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  took cp
fi
if [[ " $steps " == *" acceptance "* ]]; then
  acc=.acceptance; [ -d "$acc" ] || acc=../shared/acceptance
  for f in seed_linear_fp8 seed_tutorial_layer seed_vit_block; do
    ACCEPT_DEVICE=cuda $PY "$acc/$f.py" >"$OUT/accept_$f.log" 2>&1 && echo "acceptance $f: passed" \
      || { echo "acceptance $f: FAILED"; grep -E "FAIL|Error" "$OUT/accept_$f.log" | head -10; rc=1; }
  done
fi

if [[ " $steps " == *" tutorial "* ]]; then
  if ls .whl/torchao-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  $PY benchmarks/gpu_tutorial_layer.py --out "$OUT" 2>&1 | tee "$OUT/tutorial_layer.log" | tail -15
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi

if [[ " $steps " == *" quickstart "* ]]; then
  # QUICKSTART_ARGS: extra options (other sizes); QUICKSTART_TAG names their logs
  for seed in ${QUICKSTART_SEEDS:-0}; do
    log=quickstart${QUICKSTART_TAG:-}_seed$seed
    $PY examples/quickstart.py --device cuda --steps 300 --no-sample --seed "$seed" ${QUICKSTART_ARGS:-} \
      --plot "$OUT/$log.png" >"$OUT/$log.log" 2>&1 || rc=1
    echo "quickstart${QUICKSTART_TAG:+ $QUICKSTART_TAG} seed $seed:"; tail -5 "$OUT/$log.log"
  done
  took quickstart
fi

if [[ " $steps " == *" host "* ]]; then
  $PY benchmarks/host_overhead.py --device cuda 2>&1 | tee "$OUT/host_overhead.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi

if [[ " $steps " == *" profile "* ]]; then
  ncu --clock-control none -k "regex:tile_kernel|norm_fwd|norm_bwd|act_kernel" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis $PY benchmarks/gpu_profile_memory.py >"$OUT/ncu.txt" 2>&1 || rc=1
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots|No Eligible|Stall" \
    "$OUT/ncu.txt" | head -80
fi
if [[ " $steps " == *" ab "* ]]; then
  # ab: AB_BENCH (a benchmark script that takes --json FILE) run AB_ROUNDS times (default 3) on
  # this package and on a base library alternately: AB_BASE_LIB, a libtransformer_engine.so.0.1.0
  # (or .xz of one) from an older build carried along, swapped into a copy of the package. The
  # two builds cannot share a process, so process runs alternate (the card's clock drifts);
  # per-case medians and base/new ratios go to $OUT/ab.txt.
  base=/tmp/nvte_pkg_base
  rm -rf "$base" && cp -r "$STAGE" "$base"
  $PY -c "import lzma, shutil, sys; src = sys.argv[1]; op = lzma.open if src.endswith('.xz') else open
with op(src, 'rb') as f, open(sys.argv[2], 'wb') as g: shutil.copyfileobj(f, g)" \
    "$AB_BASE_LIB" "$base/transformer_engine/libtransformer_engine.so.0.1.0" || exit 1
  for r in $(seq "${AB_ROUNDS:-3}"); do
    PYTHONPATH=$base $PY "$AB_BENCH" --json "$OUT/ab_base_$r.json" >"$OUT/ab_base_$r.log" 2>&1 || rc=1
    $PY "$AB_BENCH" --json "$OUT/ab_new_$r.json" >"$OUT/ab_new_$r.log" 2>&1 || rc=1
  done
  $PY - "$OUT" <<'PYEOF' | tee "$OUT/ab.txt"
import glob, json, statistics, sys
runs = {side: [json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/ab_{side}_*.json"))] for side in ("base", "new")}
for case in runs["new"][0]:
    for metric in runs["new"][0][case]:
        med = {side: statistics.median(r[case][metric] for r in rs) for side, rs in runs.items()}
        print(f"{case} {metric}: base {med['base']:.4f} new {med['new']:.4f} base/new {med['base'] / med['new']:.3f}")
PYEOF
  took ab
fi
if [[ " $steps " == *" pack "* ]]; then
  (cd "$OUT" && tar czf /tmp/nvte_logs.tgz --exclude=logs.tgz . && find . -mindepth 1 -delete && mv /tmp/nvte_logs.tgz logs.tgz)
fi
exit $rc
