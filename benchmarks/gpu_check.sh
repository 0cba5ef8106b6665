#!/usr/bin/env bash
# The prepared GPU check, for a session whose task is lent a CUDA machine (one run of about 8-10 minutes):
# the CUDA tests (KV restore and CPU<->CUDA migration, sampling CPU == CUDA, host-resident decode: staged
# restores through pinned bounce buffers on a side stream equal device-resident attention bit for bit, CPU
# attention beside the pinned host pool, greedy parity with transformers under host-resident and mixed decode
# on CUDA; weight streaming: pinned host copies, side-stream copies with prefetch into two device staging
# slots, equal to all-resident logits, and flexgen streaming whole layers equal to transformers' greedy
# outputs), the executor's CPU parity tests, and the throughput benchmark on the GPU (coroutine with
# host-resident decode through the staging buffers, then with CPU attention). The device image has torch and
# transformers but not simpy, hydra-core, omegaconf or gguf; bring them as wheels:
#   here:   python -m pip download --no-deps simpy hydra-core omegaconf antlr4-python3-runtime==4.9.3 -d .wheels
#           echo /.wheels/ >> .git/info/exclude
#   there:  run(command="bash benchmarks/gpu_check.sh", carry=[".wheels"], timeout_s=600)
# Each stage has its own time limit, so that what finished still comes back. Results land in $OUT
# (device.txt, gpu_tests.txt, weight_stream.txt, parity.txt, bench.txt, bench_cpu_attention.txt).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .wheels ]; then
    "$PY" -m pip install --no-deps --no-index .wheels/*.whl > "$OUT/pip.txt" 2>&1
fi
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
{ nvidia-smi; "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } > "$OUT/device.txt" 2>&1
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/exec --ignore=tests/exec/test_weight_stream.py \
    --ignore=tests/exec/test_offload_parity.py 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/exec/test_weight_stream.py \
    tests/exec/test_offload_parity.py 2>&1 | tee "$OUT/weight_stream.txt"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" tests/exec/test_exec_parity.py \
    tests/exec/test_host_resident.py 2>&1 | tee "$OUT/parity.txt"
timeout 200 "$PY" benchmarks/exec_throughput.py --device cuda --dtype bfloat16 --prompts 256 --kv-mb 48 \
    --residency host --attention gpu 2>&1 | tee "$OUT/bench.txt"
timeout 60 "$PY" benchmarks/exec_throughput.py --device cuda --dtype bfloat16 --prompts 256 --kv-mb 48 \
    --residency host --attention cpu --engines coroutine 2>&1 | tee "$OUT/bench_cpu_attention.txt"
# Calibration of this GPU (issue 8): the executor's modules over the quick grid, bf16, into $OUT; fit it with
#   python -m batchgen.calibrate profile=<that file> hardware=h200 out=conf/efficiency/h200.yaml
# (in_run=false: the in-run stage would build the whole model; run it with a model that fits, e.g. small_moe)
timeout 300 "$PY" -m batchgen.profile model=qwen3_30b_a3b backend.device=cuda backend.dtype=bfloat16 \
    hardware=h200 in_run=false out="$OUT/calibration-h200-qwen3_30b_a3b.json" 2>&1 | tee "$OUT/profile.txt"
# backend=dist on NCCL (issue 9): one process per GPU, so it needs at least 2 GPUs (init_distributed refuses
# two processes on one device); with one GPU, a 1-process CUDA run still checks the CUDA path of the backend.
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
DIST_PROCS=$(( GPUS >= 2 ? 2 : 1 ))
timeout 180 torchrun --nproc-per-node="$DIST_PROCS" -m batchgen.experiment +policy=coroutine backend=dist \
    backend.procs="$DIST_PROCS" backend.device=cuda model=tiny_moe workload.num_sequences=32 output.plot=false \
    hydra.run.dir="$OUT/dist_run" 2>&1 | tee "$OUT/dist_nccl.txt"
