#!/bin/bash
# Session 9 call B: in-kernel bf16 rounding of the FP8 weight refresh (GPU tests, timing), 235B head-to-head.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p $OUT/b
echo "== pytest"; PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest tests/test_weight_cache.py tests/test_fp8.py -k "one_pass or cache or quantized" -q -p no:logging > $OUT/b/pytest.txt 2>&1; rc=$?; tail -4 $OUT/b/pytest.txt
if [ $rc != 0 ]; then sed -i 's/^FUSED_BF16_ROUNDING = True/FUSED_BF16_ROUNDING = False/' models/moe/weight_cache.py; echo "FUSED ROUNDING OFF"; fi
echo "== refresh"; PYTHONPATH=.:/tmp/site timeout 100 python3 -c "from bench.fp8_kernels import main; main()" > $OUT/b/kernels.txt 2>&1; grep refresh $OUT/b/kernels.txt
echo "== compare 235B"; BENCH_COMMIT=$BENCH_COMMIT timeout 330 python3 -m bench.compare --model qwen3_235b_a22b --layers 1 --seq-len 16384 --out outputs/compare/s9b --budget 300 --profile --only titan_bf16,keep_all,keep_fp8moe --variant keep_all="--activation_checkpoint.keep attention_and_moe" --variant keep_fp8moe="--activation_checkpoint.keep attention_and_moe --quantize.moe fp8_blockwise" > $OUT/b/compare_log.txt 2>&1
tail -3 $OUT/b/compare_log.txt; grep "^|" outputs/compare/s9b/compare.md
tar czf $OUT/b/s9b.tgz outputs/compare/s9b --exclude='*trace*' --exclude='data' 2>/dev/null
