#!/usr/bin/env bash
# One device-machine session: the GPU test suite, then recipes/bench.py at both shapes, eager and
# CUDA-graph modes and training steps (TRAIN=0: none), against megatron-core's MoELayer, the plan-built layers (EXTRA_LAYERS, default
# semantic) with routing replayed against VanillaMoE, and the GEM latency profile. Logs, the curves
# and a tarball of the bench JSON go to $OUT (a handful of files, as the device tool brings back).
#   OUT=/tmp/out bash tools/gpu_session.sh                                   # all GPUs, everything
#   OUT=/tmp/out SHAPES=" " PROFILE=0 bash tools/gpu_session.sh              # tests + semantic bench only
# Knobs: SKIP_TESTS=1, SHAPES, MODES, TRAIN=0, EXTRA_LAYERS (" ": none), PROFILE=0, *_TIMEOUT (seconds), NGPU (default: all).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
fi
OUT="${OUT:-$PWD/outputs/gpu_session}"; mkdir -p "$OUT"
NGPU="${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  python3 -c 'import megatron.core as m; print("megatron-core", m.__version__)'; } > "$OUT/env.txt" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout -s KILL "${TEST_TIMEOUT:-420}" python3 -m pytest -q -p no:cacheprovider tests/gpu -rs > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" >> "$OUT/gpu_tests.log"
fi
for shape in ${SHAPES:-qwen3_30b_a3b deepseek_v2_lite}; do
  for graph in ${MODES:-false true}; do
    echo "== bench=$shape cuda_graph=$graph ws=$NGPU" >> "$OUT/bench.log"
    timeout -s KILL "${BENCH_TIMEOUT:-240}" torchrun --standalone --nproc_per_node="$NGPU" recipes/bench.py \
      parallel=gpu bench="$shape" bench.cuda_graph="$graph" bench.save_to=docs/benchmarks \
      hydra.run.dir="/tmp/runs/${shape}_${graph}" "$@" 2>&1 | grep -vE "Warning|warnings.warn|W1122|^\s*$" >> "$OUT/bench.log"
    echo "rc=${PIPESTATUS[0]}" >> "$OUT/bench.log"
  done
done
if [ "${TRAIN:-1}" = 1 ]; then  # training steps (forward + backward) against megatron's MoELayer
  for shape in ${SHAPES:-qwen3_30b_a3b deepseek_v2_lite}; do
    echo "== bench=$shape bench.train=true ws=$NGPU" >> "$OUT/bench.log"
    timeout -s KILL "${BENCH_TIMEOUT:-240}" torchrun --standalone --nproc_per_node="$NGPU" recipes/bench.py \
      parallel=gpu bench="$shape" bench.train=true bench.save_to=docs/benchmarks \
      hydra.run.dir="/tmp/runs/${shape}_train" "$@" 2>&1 | grep -vE "Warning|warnings.warn|W1122|^\s*$" >> "$OUT/bench.log"
    echo "rc=${PIPESTATUS[0]}" >> "$OUT/bench.log"
  done
fi
for layer in ${EXTRA_LAYERS:-semantic}; do  # plan-built layers: routing replayed, VanillaMoE timed in the same run
  echo "== bench=qwen3_30b_a3b layer=$layer router=replay ws=$NGPU" >> "$OUT/bench.log"
  timeout -s KILL "${BENCH_TIMEOUT:-240}" torchrun --standalone --nproc_per_node="$NGPU" recipes/bench.py \
    parallel=gpu bench=qwen3_30b_a3b router=replay layer="$layer" bench.save_to=docs/benchmarks \
    hydra.run.dir="/tmp/runs/${layer}_replay" "$@" 2>&1 | grep -vE "Warning|warnings.warn|W1122|^\s*$" >> "$OUT/bench.log"
  echo "rc=${PIPESTATUS[0]}" >> "$OUT/bench.log"
done
tar czf "$OUT/bench_json.tgz" docs/benchmarks/*.json 2>/dev/null || true
if [ "${PROFILE:-1}" = 1 ]; then  # GEM latency curves of every GPU
  timeout -s KILL "${PROFILE_TIMEOUT:-200}" torchrun --standalone --nproc_per_node="$NGPU" recipes/profile.py \
    parallel=gpu profile=qwen3_30b_a3b hydra.run.dir=/tmp/runs/profile 2>&1 | grep -vE "Warning|warnings.warn|W1122" > "$OUT/profile.log"
  cp /tmp/runs/profile/curves.npz "$OUT/curves_ws${NGPU}.npz" 2>/dev/null || true
  cp /tmp/runs/profile/curves.png "$OUT/curves_ws${NGPU}.png" 2>/dev/null || true
fi
grep -E '^[|]|^== |rc=' "$OUT/bench.log" | tail -n 40; tail -n 8 "$OUT/profile.log" 2>/dev/null; tail -n 5 "$OUT/gpu_tests.log" 2>/dev/null
