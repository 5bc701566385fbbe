#!/usr/bin/env bash
# The prepared GPU session of issue 51, run ON the lent GPU machine in one device call (about 9 minutes at most):
# install the carried wheels (.whl/, from bench/gpu_wheels.sh), check the engine server on the card
# (bench/engine_cuda_check.py), profile (bench/gpu_profile.py), then the performance run with --check
# (bench/gpu_perf.py). Everything it writes goes to $OUT (at most 8 files come back): engine_cuda_check_<card>.json,
# gpu_profile_<card>.json, gpu_perf_<card>.json, three logs, nvidia_smi.txt. The exit code is gpu_perf's
# (0 targets met, 1 a target missed, 2 none judged). CHECK_S / PROFILE_S / PERF_S cap each step, PERF_BUDGET_S is
# gpu_perf's own budget (its parts start only while time is left), PERF_ARGS adds flags (e.g. "--parts pipeline"),
# WHEELS names another wheel folder (tests/integration/test_gpu_perf.py runs this script on the CPU with none).
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
wheels=$(find "${WHEELS:-.whl}" -name '*.whl' 2>/dev/null | sort)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || { echo "gpu_session: installing the carried wheels failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia_smi.txt" 2>&1
card=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import torch, gpu_parts as g; print(g.card_tag(torch.cuda.get_device_name() if torch.cuda.is_available() else None))" 2>/dev/null || echo unknown)
# first the engine server on the card against HF there (greedy tokens, log-probs, scoring, seeded sampling,
# concurrency; the static decode path and its CUDA graphs are the CUDA default): correctness before speed, and the
# same single-stream / 64-concurrent figures as bench/results/engine_cuda_concurrency_h200.json (before issue 51)
timeout -k 10 "${CHECK_S:-60}" python3 bench/engine_cuda_check.py --out "$OUT/engine_cuda_check_$card.json" \
  --concurrency 64 --new-tokens 64 > "$OUT/engine_cuda_check.log" 2>&1
echo "engine_cuda_check: exit $?"
timeout -k 10 "${PROFILE_S:-90}" python3 bench/gpu_profile.py --out "$OUT/gpu_profile_$card.json" \
  > "$OUT/gpu_profile.log" 2>&1
echo "gpu_profile: exit $?"
timeout -k 30 "${PERF_S:-410}" python3 bench/gpu_perf.py --check --budget-s "${PERF_BUDGET_S:-380}" \
  --out "$OUT/gpu_perf_$card.json" ${PERF_ARGS:-} > "$OUT/gpu_perf.log" 2>&1
rc=$?
tail -n 25 "$OUT/gpu_perf.log"
echo "gpu_perf: exit $rc"
exit $rc
