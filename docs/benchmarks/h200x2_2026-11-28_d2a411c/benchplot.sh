#!/usr/bin/env bash
# one eager Qwen3 bench over five sizes against megatron's MoELayer: records + bench.png
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD"
timeout -s KILL 400 torchrun --standalone --nproc_per_node=2 recipes/bench.py parallel=gpu bench=qwen3_30b_a3b \
  "bench.tokens_per_rank=[64,256,1024,4096,16384]" hydra.run.dir=/tmp/bp 2>&1 | grep -vE "Warning|warnings.warn|^\s*$" | tail -25
cp /tmp/bp/bench.png /tmp/bp/*.json "$OUT/" 2>/dev/null; ls "$OUT"
