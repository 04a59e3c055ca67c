#!/bin/bash
# Session 9 call D: weight-pass launch sweep -> best as the default -> GPU test -> 235B head-to-head with the fused rounding.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p $OUT/d
echo "== weight sweep"; PYTHONPATH=.:/tmp/site timeout 90 python3 scratch/s9_weight_sweep2.py > $OUT/d/weight_sweep.txt 2>&1; tail -3 $OUT/d/weight_sweep.txt
best=$(grep ^BEST $OUT/d/weight_sweep.txt)
if [ -n "$best" ]; then set -- $best; sed -i "s/^WEIGHT_PASS_WARPS = 8/WEIGHT_PASS_WARPS = $2/; s/^WEIGHT_TRANS_FROM = 0/WEIGHT_TRANS_FROM = $3/" kernels/fp8/quant.py; fi
grep "^WEIGHT_" kernels/fp8/quant.py | tee $OUT/d/defaults.txt
echo "== pytest"; PYTHONPATH=.:/tmp/site timeout 60 python3 -m pytest tests/test_fp8.py -k "one_pass or weight" -q -p no:logging > $OUT/d/pytest.txt 2>&1; tail -1 $OUT/d/pytest.txt
echo "== compare 235B"; BENCH_COMMIT=$BENCH_COMMIT timeout 330 python3 -m bench.compare --model qwen3_235b_a22b --layers 1 --seq-len 16384 --out outputs/compare/s9d --budget 300 --profile --only titan_bf16,keep_all,keep_fp8moe --variant keep_all="--activation_checkpoint.keep attention_and_moe" --variant keep_fp8moe="--activation_checkpoint.keep attention_and_moe --quantize.moe fp8_blockwise" > $OUT/d/compare_log.txt 2>&1
grep "^|" outputs/compare/s9d/compare.md; cat outputs/compare/s9d/breakdown.md
tar czf $OUT/d/s9d.tgz outputs/compare/s9d --exclude='*trace*' --exclude='data' 2>/dev/null; true
