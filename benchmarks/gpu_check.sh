#!/usr/bin/env bash
# The one prepared GPU check (issue #8), for a session whose task is lent a device machine.
# Runs on the device's own python3 (it has CUDA torch and triton; lmstack comes from src/):
#   - tests/kernels on CUDA (test_kernels_cuda.py: Triton FlashAttention-2 and RMSNorm compiled
#     for the GPU vs the reference, fp32/bf16, causal, GQA, partial tiles)
#   - benchmarks/attention.py: Triton FA-2 (both backward schedules) vs SDPA's flash backend,
#     bf16, fwd+bwd and fwd alone, S = 1k..8k at H=64; then H=128 with GQA at S = 2k, 8k
#   - benchmarks/rmsnorm.py: Triton RMSNorm vs F.rms_norm, fwd+bwd, bf16/fp32 (decides norm auto)
# About 3–5 minutes on an H200. Call it through the device tool's `run` with timeout_s=595 (the steps are capped at 580 s):
#   bash benchmarks/gpu_check.sh
# Logs and JSON land in $OUT (the device tool brings them back).
set -u
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/lmstack-gpu-check}"
mkdir -p "$OUT"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/machine.txt"
LMSTACK_REQUIRE_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels -k "not aot" 2>&1 | tee "$OUT/pytest_kernels.log"
timeout 180 python3 benchmarks/attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
timeout 60 python3 benchmarks/rmsnorm.py --json "$OUT/rmsnorm.json" 2>&1 | tee "$OUT/rmsnorm.log"
timeout 100 python3 benchmarks/attention.py --heads 16 --kv-heads 4 --head-dim 128 --seq 2048,8192 \
  --json "$OUT/attention_h128_gqa.json" 2>&1 | tee "$OUT/attention_h128_gqa.log"
