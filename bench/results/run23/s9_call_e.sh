#!/bin/bash
# Session 9 call E (warm, right after D): the 30B proxy with D's weight-pass defaults (16 warps, transposed re-read).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
sed -i "s/^WEIGHT_PASS_WARPS = 8/WEIGHT_PASS_WARPS = 16/; s/^WEIGHT_TRANS_FROM = 0/WEIGHT_TRANS_FROM = 2/" kernels/fp8/quant.py
mkdir -p $OUT/e; BENCH_COMMIT=d07d890+weightpass16w2 timeout 340 python3 -m bench.compare --model qwen3_30b_a3b --layers 4 --seq-len 16384 --out outputs/compare/s9e --budget 280 --only titan_bf16,keep_all,keep_fp8moe --variant keep_all="--activation_checkpoint.keep attention_and_moe" --variant keep_fp8moe="--activation_checkpoint.keep attention_and_moe --quantize.moe fp8_blockwise" > $OUT/e/compare_log.txt 2>&1
