#!/bin/bash
# Session 7 call D: FP8 tests on the GPU (gate/up at 128 rows), dh diagnosis, 30B proxy with FP8 projections.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p $OUT/d
echo "== pytest"; PYTHONPATH=.:/tmp/site timeout 150 python3 -m pytest tests/test_mega_moe_fp8.py tests/test_fp8.py -q -p no:logging > $OUT/d/pytest.txt 2>&1; tail -4 $OUT/d/pytest.txt
echo "== dh"; PYTHONPATH=.:/tmp/site timeout 60 python3 scratch/ncu_dh.py --time 2>&1 | grep dh | tee $OUT/d/dh_time.txt
PYTHONPATH=.:/tmp/site timeout 60 ncu --clock-control none -k regex:_fp8_dh_kernel --launch-skip 1 --launch-count 1 --set full -o $OUT/d/dh python3 scratch/ncu_dh.py > $OUT/d/ncu_log.txt 2>&1
ncu -i $OUT/d/dh.ncu-rep --page details > $OUT/d/dh_details.txt 2>&1; ncu -i $OUT/d/dh.ncu-rep --page source --csv --print-source sass > $OUT/d/dh_src.csv 2>&1
grep -E "Duration|Registers Per|Local|Achieved Occupancy|Spill|Compute \(SM\) Throughput|Memory Throughput" $OUT/d/dh_details.txt | head -20
echo "== compare 30B"; BENCH_COMMIT=$BENCH_COMMIT timeout 300 python3 -m bench.compare --model qwen3_30b_a3b --layers 4 --seq-len 16384 --out outputs/compare/s7b --budget 280 --only titan_bf16,keep_all,keep_fp8lin --variant keep_all="--activation_checkpoint.keep attention_and_moe" --variant keep_fp8lin="--activation_checkpoint.keep attention_and_moe --quantize.linear fp8_rowwise" > $OUT/d/compare_log.txt 2>&1
tail -3 $OUT/d/compare_log.txt; grep "^|" outputs/compare/s7b/compare.md
tar czf $OUT/d/s7b.tgz outputs/compare/s7b --exclude='*trace*' 2>/dev/null
