#!/bin/bash
# Session 9 call C: cache tests on the GPU (fixed device), weight-pass launch sweep, 30B head-to-head with the fused rounding.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p $OUT/c
echo "== pytest"; PYTHONPATH=.:/tmp/site timeout 120 python3 -m pytest tests/test_weight_cache.py -q -p no:logging > $OUT/c/pytest.txt 2>&1; tail -3 $OUT/c/pytest.txt
grep -q "^FUSED_BF16_ROUNDING = True" models/moe/weight_cache.py && echo "fused rounding on"
echo "== weight sweep"; PYTHONPATH=.:/tmp/site timeout 60 python3 scratch/s9_weight_sweep.py 2>&1 | tee $OUT/c/weight_sweep.txt | tail -14
echo "== compare 30B"; BENCH_COMMIT=$BENCH_COMMIT timeout 330 python3 -m bench.compare --model qwen3_30b_a3b --layers 4 --seq-len 16384 --out outputs/compare/s9c --budget 300 --profile --only titan_bf16,keep_all,keep_fp8moe --variant keep_all="--activation_checkpoint.keep attention_and_moe" --variant keep_fp8moe="--activation_checkpoint.keep attention_and_moe --quantize.moe fp8_blockwise" > $OUT/c/compare_log.txt 2>&1
tail -2 $OUT/c/compare_log.txt; grep "^|" outputs/compare/s9c/compare.md; cat outputs/compare/s9c/breakdown.md
tar czf $OUT/c/s9c.tgz outputs/compare/s9c --exclude='*trace*' --exclude='data' 2>/dev/null
