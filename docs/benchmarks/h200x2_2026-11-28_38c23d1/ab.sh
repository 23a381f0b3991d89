#!/usr/bin/env bash
# A/B of the eager Qwen3 bench (ours only), old (../snap_old) and new (.) alternated twice on this machine
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
for i in 1 2; do for v in snap_old snap; do
  (cd "../$v" && PYTHONPATH="/tmp/site:$PWD" timeout -s KILL 120 torchrun --standalone --nproc_per_node=2 recipes/bench.py \
     parallel=gpu bench=qwen3_30b_a3b bench.peer=false hydra.run.dir="/tmp/ab_${v}_$i" 2>&1 \
     | grep -E "^[|]|Error|error" | head -12 > "$OUT/ab_${v}_$i.txt")
  echo "== $v $i"; grep -E "256|4096" "$OUT/ab_${v}_$i.txt" | head -4
done; done
