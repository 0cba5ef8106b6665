#!/usr/bin/env bash
# The prepared GPU check, for a session whose task is lent a CUDA machine (one run of about 5-8 minutes):
# the CUDA tests (KV restore and CPU<->CUDA migration, sampling CPU == CUDA), the executor's parity tests, and
# the throughput benchmark on the GPU. The device image has torch and transformers but not simpy, hydra-core,
# omegaconf or gguf; bring them as wheels:
#   here:   python -m pip download --no-deps simpy hydra-core omegaconf antlr4-python3-runtime==4.9.3 -d .wheels
#           echo /.wheels/ >> .git/info/exclude
#   there:  run(command="bash benchmarks/gpu_check.sh", carry=[".wheels"], timeout_s=540)
# Results land in $OUT (device.txt, gpu_tests.txt, parity.txt, bench.txt).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .wheels ]; then
    "$PY" -m pip install --no-deps --no-index .wheels/*.whl > "$OUT/pip.txt" 2>&1
fi
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi; "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } > "$OUT/device.txt" 2>&1
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests/exec 2>&1 | tee "$OUT/gpu_tests.txt"
"$PY" -m pytest -q -p no:cacheprovider tests/exec/test_exec_parity.py 2>&1 | tee "$OUT/parity.txt"
"$PY" benchmarks/exec_throughput.py --device cuda --dtype bfloat16 --prompts 256 --kv-mb 48 2>&1 | tee "$OUT/bench.txt"
