#!/bin/bash
# Session 7 call A: FP8 projections check, FP8 GEMM exploration, ncu. Output under $OUT.
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/a/gpu.txt
echo "== fp8 linear diag"; timeout 120 python3 scratch/diag2.py cuda 2>&1 | grep -v Warning | tee $OUT/a/diag2.txt | tail -8
echo "== explore"; timeout 260 python3 scratch/fp8_explore.py > $OUT/a/explore.txt 2>&1; tail -45 $OUT/a/explore.txt
echo "== ncu"; timeout 150 ncu --clock-control none -k regex:"_fp8_gate_up_kernel|_fp8_gemm_kernel|_xk" --launch-skip 0 --launch-count 12 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
  --section ComputeWorkloadAnalysis --section SourceCounters -o $OUT/a/ncu python3 scratch/ncu_fp8.py > $OUT/a/ncu_log.txt 2>&1
tail -3 $OUT/a/ncu_log.txt
ncu -i $OUT/a/ncu.ncu-rep --page details > $OUT/a/ncu_details.txt 2>&1
grep -E "^  [_a-z]|Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Stall|Issue Slot|No Eligible|Warp Cycles Per Issued|Local" $OUT/a/ncu_details.txt | head -150
ncu -i $OUT/a/ncu.ncu-rep --page raw --csv --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle > $OUT/a/ncu_raw.csv 2>&1
for i in 0 2 4 6 8 10; do ncu -i $OUT/a/ncu.ncu-rep --page source --csv --print-source sass --launch-skip $i --launch-count 1 > $OUT/a/src_$i.csv 2>&1; done
ls -la $OUT/a
echo "== pytest"; timeout 150 python3 -m pytest tests/test_float8_linear.py tests/test_fp8.py tests/test_adamw.py -q -x -k "cuda or lag or shadow" -p no:logging 2>&1 | tail -6
