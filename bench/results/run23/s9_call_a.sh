#!/bin/bash
# Session 9 call A: the one-pass weight refresh on the GPU (tests), refresh timings, whole-op table with DH_COLS / GATE_UP_PREGATHER.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $OUT/a/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/a/gpu.txt
echo "== pytest"; PYTHONPATH=.:/tmp/site timeout 200 python3 -m pytest tests/test_fp8.py tests/test_mega_moe_fp8.py tests/test_weight_cache.py -q -p no:logging -x > $OUT/a/pytest.txt 2>&1; tail -6 $OUT/a/pytest.txt
echo "== kernels"; PYTHONPATH=.:/tmp/site timeout 100 python3 -c "from bench.fp8_kernels import main; main()" > $OUT/a/kernels.txt 2>&1; tail -24 $OUT/a/kernels.txt
echo "== op"; PYTHONPATH=.:/tmp/site timeout 170 python3 -c "from bench.fp8_kernels import time_moe_ops; time_moe_ops()" > $OUT/a/op.txt 2>&1; tail -24 $OUT/a/op.txt
