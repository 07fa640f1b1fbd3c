#!/usr/bin/env bash
# The whole GPU check as one prepared device run (about 5 minutes on one H200):
# correctness first (tests/gpu_checks.py: compiled kernels vs the torch reference, CUDA-graph
# decode vs the CPU engine, the staged host tier), then speed (bench/gpu_kernels.py); logs and
# the JSON result go to $OUT.
#
# The device image has torch, triton, safetensors, tokenizers, jinja2 and tqdm, but not
# msgspec or lz4; fetch their wheels on the CPU machine first (.whl/ is git-ignored):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl msgspec lz4
# then run `bash bench/gpu_run.sh` on the device with carry [".whl"] and a 540 s timeout.
set -uo pipefail
OUT=${OUT:-/tmp/kvsession-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        >"$OUT/install.log" 2>&1; then
    cat "$OUT/install.log"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
timeout 200 python3 tests/gpu_checks.py 2>&1 | tee "$OUT/gpu_checks.log"
checks=${PIPESTATUS[0]}
timeout 300 python3 bench/gpu_kernels.py --out "$OUT/gpu_kernels.json" 2>&1 \
    | tee "$OUT/gpu_kernels.log"
bench=${PIPESTATUS[0]}
echo "gpu_checks rc=$checks, gpu_kernels rc=$bench"
exit $((checks || bench))
