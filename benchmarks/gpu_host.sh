#!/usr/bin/env bash
# Every GPU check that issues 16 and 18 ask for, in one run of at most 9½ minutes (about 7½ when
# nothing hangs; the extra steps, GPU_HOST_EXTRA=only, about 6 more, in a second call where
# the device time allows) on a lent GPU host (one H100 or H200, 16 cores), since such a host is
# lent for 15 minutes a task at most.
#
# Each step has a time limit of its own, so a step that hangs costs only its limit; each writes
# its log to $OUT/<step>.log, and $OUT/summary.txt says what ran where, each step's exit status
# and its seconds, with the short logs (data, server_start) appended: at most 7 files, since the
# device returns at most 8.
#
#   1. data          workload A's synthetic ImageFolder, 4,096 JPEGs (shared by the steps below)
#   2. cuda_tests    pytest -m cuda: transfer, pinning, GPU decode (test_io needs av)
#   3. train_e2e     ResNet-50 (bf16, channels_last) fed by torch, the import swap, the fast
#                    path and GPU decode, against the model alone (issue 16's end-to-end target,
#                    issue 18's GPU-decode one); a first pass untimed, its seconds reported,
#                    and the first batch's (a trial on 4 of 15 threads, where "auto" runs one)
#      train_e2e_persistent  torch, the fast path and GPU decode with persistent_workers=True
#                    and each file listed 4 times: the timed steps inside one pass, as most of
#                    a training job's long epochs are, without a short pass's start; and the
#                    fast path with its workers at the loop's priority (@nice=0), against the
#                    default 10 below it: 15 workers on 16 cores share them with the loop
#   4. bench_A       workload A at 1, 8 and 16 workers: threads against torch's processes, and
#                    the GPU-decode variant (issue 18's loader-alone target), timed in a second
#                    pass (--warmup 8): a first pass of 8 batches on 16 cores is mostly "auto"'s
#                    trial and the start of its processes
#   5. gpu_budget    where the GPU decode path loses to the model alone: the GPU's kernel time
#                    of a step and of a batch's decode and crops, and the model with the decode
#                    issued from its own thread and from a second one (benchmarks/gpu_budget.py;
#                    gpu_pass_probe.py, which found the first-batch and fork-server costs that
#                    are fixed now, runs by hand)
# With GPU_HOST_EXTRA=1, after the steps above, or GPU_HOST_EXTRA=only, after data alone (a
# second device call; server_start measured the same on the H100s and the H200 of 2026-11-23
# to 27, docs/performance.md; they make room for bench_A's second pass):
#   6. worker_start  each pass's start of 15 worker processes, torch's forked from the main
#                    process against ours from the fork server, beside D's training step: the
#                    first batch and the pass (benchmarks/worker_start.py; on 2 cores, ours
#                    restarted OpenBLAS's pool in each worker until 2026-11-28)
#   7. server_start  what a fork server's start is made of: a fresh interpreter importing torch,
#                    torchvision and torch_spdl's worker module, then a fork server preloading
#                    them up to its first worker (7.6 s on the H200, 4-4.5 s on 2 cores)
#   8. threads_or_processes  on 15 workers, threads against processes where the GIL binds a
#                    little or not at all (tensor ops, a torch and a NumPy matmul per sample),
#                    and what "auto" chose (benchmarks/threads_or_processes.py)
#   9. worker_wait   whether worker processes wait between batches, torch's against ours, at 1,
#                    8 and 16 workers of a persistent loader beside a 5 ms training step: images/s,
#                    the workers' busy fraction, main-process CPU per image; on 2 cores one worker
#                    of ours went from 0.92-0.95 busy to 1.01 once its next task was sent ahead
#                    (benchmarks/worker_wait.py; a driving thread per worker in the main process)
#  10. train_e2e_workers  the GPU decode in the transfer stage against the same decode done by
#                    each worker process on its own batch (nvJPEG, and nvImageCodec's hardware
#                    decoder), the decoded batch crossing by CUDA IPC: whether the main process's
#                    one transfer thread is what kept the GPU decode path at 54-67 % of the model
# benchmarks/gpu_transfer.py (the transfer stage's bandwidth, measured the same on every host),
# gpu_decoders.py (nvJPEG against nvImageCodec) and gpu_decode_steps.py ran on two
# H100s and an H200 (docs/performance.md); run them by hand where a new GPU asks for it.
#
# Wheels the device's Python (3.12) lacks travel in .whl (carry it), made here beforehand:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl av nvidia-nvimgcodec-cu13 'nvidia-nvjpeg>=13' threadpoolctl
# (about 61 MiB with the repository: the device takes 64.) Then, on the device tool:
#   run(command="bash benchmarks/gpu_host.sh", carry=[".whl"], timeout_s=600)
# Without a GPU the CUDA steps skip or say so, which is how this script is checked off one.
set -u
OUT=${OUT:-$PWD/gpu_host_out}
mkdir -p "$OUT"
summary=$OUT/summary.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
IMAGES=${GPU_HOST_IMAGES:-4096}

if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_host_site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/gpu_host_site
fi

{
    date -u
    nproc
    nvidia-smi -L 2>&1 || true
    $PY -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision',
        torchvision.__version__, torch.cuda.get_device_name() if torch.cuda.is_available()
        else 'no CUDA')"
    $PY -c "import av; print('av', av.__version__)" 2>&1 | tail -1
    $PY -c "from torch_spdl.io.region import region_decoder; print('region decoder:',
        region_decoder() is not None)"
} > "$summary" 2>&1

finish() { # the device returns at most 8 files: the short logs go into the summary
    for name in data worker_start server_start threads_or_processes worker_wait; do
        [ -f "$OUT/$name.log" ] || continue
        { echo; echo "== $name.log"; cat "$OUT/$name.log"; } >> "$summary" && rm "$OUT/$name.log"
    done
    cat "$summary"
}

step() { # step NAME SECONDS COMMAND...: run it under its limit, log it, note rc and seconds
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - began)) s (limit $limit): ${*//$'\n'/; }" >> "$summary"
}

step data 40 $PY -c "import torch_spdl.bench.data as d
print(d.synthetic_imagefolder(d.ImageSpec($IMAGES)))"
if [ "${GPU_HOST_EXTRA:-0}" != only ]; then
step cuda_tests 45 $PY -m pytest -m cuda -q -rs -p no:cacheprovider \
    tests/test_transfer.py tests/test_pin_memory.py tests/test_io.py
# two passes of warm-up: "auto"'s trial and the fork server's start happen once a job, and the
# warm-up column reports them; the timed steps are the passes after, three of 16 batches
step train_e2e 140 $PY benchmarks/train_e2e.py --images "$IMAGES" --rounds 1 --steps 48 \
    --warmup $((IMAGES / 128)) --loaders torch,torch_spdl,torch_spdl:fast,torch_spdl:gpu-decode --stats
# the steady state: passes of 4 × 16 batches, the timed steps inside the third, after two
# whole passes (a 16-batch pass spends a sizeable share refilling the pipeline at its start)
step train_e2e_persistent 175 $PY benchmarks/train_e2e.py --images "$IMAGES" --repeat 4 \
    --rounds 1 --steps 48 --warmup $((IMAGES / 32)) --persistent \
    --loaders torch,torch_spdl:fast,torch_spdl:gpu-decode,torch_spdl:fast@nice=0 --stats
step bench_A 135 $PY -m torch_spdl.bench --workloads A --images "$IMAGES" --rounds 1 \
    --batches 8 --warmup 8 --no-analysis --out /tmp/gpu_host_bench
step gpu_budget 35 $PY benchmarks/gpu_budget.py --images "$IMAGES" --steps 20
fi
[ "${GPU_HOST_EXTRA:-0}" = 0 ] && { finish; exit; }
step worker_start 60 $PY benchmarks/worker_start.py --workers 15 --rounds 4 --images "$IMAGES"
step server_start 20 $PY -c "import multiprocessing, subprocess, sys, time
wanted = ['torch', 'torchvision', 'torch_spdl.processes']
began = time.perf_counter()
run = subprocess.run([sys.executable, '-X', 'importtime', '-c', 'import ' + ', '.join(wanted)],
                     capture_output=True, text=True, check=True)
print(f'a fresh interpreter imports {wanted}: {time.perf_counter() - began:.2f} s, of which')
for line in run.stderr.splitlines():  # 'import time: self | cumulative | name', warnings too
    fields = line.split(':', 1)[1].split('|') if line.startswith('import time:') else []
    if len(fields) == 3 and fields[1].strip().isdigit() and not fields[2].startswith('  '):
        if int(fields[1]) > 100_000:  # a top-level import of over 0.1 s
            print(f'  {fields[2].strip()}: {int(fields[1]) / 1e6:.2f} s')
context = multiprocessing.get_context('forkserver')
context.set_forkserver_preload(wanted)
began = time.perf_counter()
worker = context.Process(target=print)
worker.start()
worker.join()
print(f'fork server up and its first worker done: {time.perf_counter() - began:.2f} s')"
step threads_or_processes 90 $PY benchmarks/threads_or_processes.py --workers 15 --rounds 1 \
    --images "$IMAGES" --workloads tensor,matmul,numpy
step worker_wait 90 $PY benchmarks/worker_wait.py --rounds 1 --workers 1,8,16 --batches 100
step train_e2e_workers 150 $PY benchmarks/train_e2e.py --images "$IMAGES" --repeat 4 \
    --rounds 1 --steps 48 --warmup $((IMAGES / 32)) --persistent --stats --loaders \
    torch_spdl:gpu-decode,torch_spdl:gpu-decode-workers,torch_spdl:gpu-decode-workers-hw
finish
