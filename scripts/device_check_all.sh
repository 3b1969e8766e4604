#!/usr/bin/env bash
# Everything a session that draws a GPU checks, in one device call of ~9 minutes (a session has 15), with nothing
# but this repo on the machine (no checkpoint travels: the engine runs random weights of real shapes):
#   1. the paged attention kernel compiled (Triton) at llama-7b / llama-3-8b shapes: against the reference, time,
#      bandwidth (scripts/device_check.py, budget 60 s);
#   2. the engine end to end on the device: AR decode of SmolLM2-135M and llama-7b shapes at batch 1 and 64 against
#      the weights' floor, the step cost per γ of llama-7b + llama-68m, and on that engine the draft's offload and
#      reload times and a decode on extension pages (scripts/device_check_engine.py);
#   3. the tests that exercise the accelerator path, run on it: the compiled kernel bodies (incl. tree masks),
#      continuous batching through a real model, speculative decoding and token trees (greedy SD == AR);
#   4. elastic memory on the device: the draft's weights to pinned host memory and back, an extension KV pool read
#      by the Pallas path, greedy SD across offload / reload == AR (tests/memory, tests/kernels/test_extension_pool.py).
# Limits from the first run (2026-12-04): the kernel and tree tests reached ~85% in 150 s, the engine tests took
# 66 s. Each part has its own time limit; a failing part does not stop the next. Logs and JSON go to $OUT (else
# results/). Usage on the device tool: `bash scripts/device_check_all.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-results}"
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TF_CPP_MIN_LOG_LEVEL=2
python3 -c "import sys, jax, flax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, \
jax.default_backend(), jax.devices())" 2>&1 | tee "$out_dir/env.log"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$out_dir/env.log"

timeout 90 python3 scripts/device_check.py --budget-s 60 --out "$out_dir/device_check_results.json" \
    > "$out_dir/attention.log" 2>&1
echo "attention check exit $?"; tail -25 "$out_dir/attention.log"

timeout 240 python3 scripts/device_check_engine.py --budget-s 150 --batch-sizes 1,64 --gammas 0,2,4 \
    --out "$out_dir/device_check_engine.json" > "$out_dir/engine.log" 2>&1
echo "engine check exit $?"; grep -v "^ *File\|^    " "$out_dir/engine.log" | tail -30

# the kernel bodies first (fast, the most device-specific), then the engine through a real model
JAX_PLATFORMS=cuda,cpu timeout 170 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short \
    tests/kernels/test_paged_attention.py tests/spec/test_tree.py > "$out_dir/pytest_gpu_kernels.log" 2>&1
echo "pytest (kernels, trees) exit $?"; grep -E "FAILED|ERROR|passed|failed" "$out_dir/pytest_gpu_kernels.log" \
    | tail -20
JAX_PLATFORMS=cuda,cpu timeout 80 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short \
    tests/engine/test_engine_real.py > "$out_dir/pytest_gpu_engine.log" 2>&1
echo "pytest (engine) exit $?"; grep -E "FAILED|ERROR|passed|failed" "$out_dir/pytest_gpu_engine.log" | tail -20
JAX_PLATFORMS=cuda,cpu timeout 90 python3 -m pytest -v -p no:cacheprovider -rfE --tb=short \
    tests/memory tests/kernels/test_extension_pool.py > "$out_dir/pytest_gpu_memory.log" 2>&1
echo "pytest (elastic memory) exit $?"; grep -E "FAILED|ERROR|passed|failed" "$out_dir/pytest_gpu_memory.log" | tail -20
