#!/usr/bin/env bash
# The 1-GPU check on a lent GPU machine with no network (docs/gpu_check.md): install the carried wheels (.whl/,
# built here by tools/device_wheels.py), train every cut on both sides, re-check the results with the `gpu` test,
# and pack logs + results into $OUT (at most 8 files come back, so the logs travel as one tarball).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device_out}
mkdir -p "$OUT"
python3 -c "import platform; print('glibc', *platform.libc_ver())" | tee "$OUT/device.txt"
# nvidia-resiliency-ext ships only manylinux_2_39 wheels; with an older glibc pip refuses the whole line, so it is
# installed on its own and, if refused, unpacked: Bridge's pretrain imports only pure-Python modules of it (its one
# extension, nvrx_cupti_module, serves straggler detection, which the check leaves off).
nvrx=(.whl/nvidia_resiliency_ext-*.whl)
rest=($(ls .whl/*.whl | grep -v nvidia_resiliency_ext))
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@"; }
pip_target "${rest[@]}" || { echo "error: installing .whl/ failed: rebuild it with tools/device_wheels.py"; exit 2; }
pip_target "${nvrx[@]}" 2>/dev/null || { echo "glibc < 2.39: unpacking ${nvrx[0]}"; python3 -m zipfile -e "${nvrx[0]}" /tmp/site; }
export PYTHONPATH="/tmp/site:$PWD/src:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/device.txt"
run=runs/gpu_cut/device
python3 bench/gpu_cut.py --out "$run" --budget-s "${BUDGET_S:-420}" "$@" 2>&1 | tee "$OUT/gpu_cut.txt"
rc=${PIPESTATUS[0]}
GPU_CUT_RESULTS="$run/results.json" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/pytest_gpu.txt"
cp "$run/results.json" "$OUT/" 2>/dev/null
tar czf "$OUT/gpu_cut_logs.tgz" -C "$run" .
exit "$rc"
