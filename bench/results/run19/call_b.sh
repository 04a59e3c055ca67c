#!/bin/bash
# Session 7 call B: prefetched FP8 scales (production) and explore v2.
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/b
echo "== pytest"; timeout 170 python3 -m pytest tests/test_fp8.py tests/test_mega_moe_fp8.py tests/test_float8_linear.py -q -x -p no:logging > $OUT/b/pytest.txt 2>&1; tail -4 $OUT/b/pytest.txt
echo "== fp8_kernels"; timeout 150 python3 -m bench.fp8_kernels > $OUT/b/fp8_kernels.txt 2>&1; cat $OUT/b/fp8_kernels.txt | grep -v Warn
echo "== sweep"; timeout 100 python3 -m bench.fp8_kernels --sweep > $OUT/b/sweep.txt 2>&1; tail -30 $OUT/b/sweep.txt
echo "== explore"; timeout 150 python3 scratch/fp8_explore.py > $OUT/b/explore.txt 2>&1; tail -80 $OUT/b/explore.txt | grep -v failed
