#!/usr/bin/env bash
# The project on a machine with one GPU, in under 4 minutes: the GPU tests (`pytest -m gpu`: one device, dp over
# [0], ddp over NCCL, bf16-mixed, free:1, fsdp and its resume, the refused free-memory floor, ...) beside the fast
# suite, then the GPU benchmark alone. CI has no GPU; run this by hand after
#   pip install "torch==<a CUDA build>" -e ".[dev,gpu]"
# or from a plain copy of the repository (this script puts it on PYTHONPATH). Usage:
#   scripts/gpu_check.sh [RESULTS_FOLDER]       (default: a new folder under /tmp; PYTHON picks the interpreter)
# Every step runs in its own session under `timeout -k`, and whatever it started is ended with it (DataLoader
# workers, DDP ranks, xdist workers, tests' children in sessions of their own). The folder gets a log per step, the
# benchmark's table and summary.txt (step, status, seconds). Exit 0 only if every step passed.
set -uo pipefail

PYTHON=${PYTHON:-python}
# The GPU workload of scripts/benchmark.py, a few repeats: the project, bare Lightning and a hand-written loop.
# One repeat: its 4 processes each import torch and Lightning (11-15 s apiece on the first GPU machine measured).
BENCHMARK=(--workload conv --strategies single --repeats 1 --steps 150 --warmup 20 --timeout 60)
PYTEST=(-q -p no:cacheprovider --tb=short)
# Seconds per step (the environment may set them); the two test steps run side by side: at most 5 + 130 + 100 s.
PREFLIGHT_S=${PREFLIGHT_S:-5}
TESTS_S=${TESTS_S:-130}
BENCHMARK_S=${BENCHMARK_S:-100}
# module=what provides it, for the one line naming what an offline CUDA image lacks.
REQUIRED=(torch=torch lightning=lightning torchmetrics=torchmetrics jsonargparse=jsonargparse
    docstring_parser=docstring-parser typeshed_client=typeshed-client yaml=PyYAML tensorboard=tensorboard
    torchdata=torchdata pynvml=nvidia-ml-py pytest=pytest xdist=pytest-xdist pytest_timeout=pytest-timeout
    filelock=filelock matplotlib=matplotlib)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$(mktemp -d /tmp/gpu-check.XXXXXX)}")
if [[ $out/ == "$repo"/* ]]; then
    # The suite fails a session that writes into the project; its logs would.
    echo "error: the results folder $out is inside the repository; give one outside it"
    exit 2
fi
mkdir -p "$out" || exit 2
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
echo "results: $out"

run_step() {
    # run_step NAME SECONDS COMMAND...: COMMAND in its own session under timeout, output in NAME.log; NAME.status
    # gets "status seconds". A token in the environment finds the processes that left the session (test runs
    # start theirs with start_new_session) so that none outlives the step.
    local name=$1 limit=$2 start=$SECONDS code status token
    shift 2
    token="gpu-check-$$-$name"
    GPU_CHECK_STEP=$token setsid -w timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    code=$?
    reap "$token"
    case $code in
        0) status=passed ;;
        124 | 137) status="TIMEOUT after ${limit}s" ;;
        *) status="FAILED (exit $code)" ;;
    esac
    echo "$status|$((SECONDS - start))" >"$out/$name.status"
    echo "== $name: $status"
}

reap() {
    # Kill every process whose environment carries the step's token.
    local token=$1 environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if [[ $pid != "$$" ]] && { tr '\0' '\n' <"$environ" | grep -qx "GPU_CHECK_STEP=$token"; } 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null
        fi
    done
}

summary() {
    # One line per step: name, status, seconds, and the last line of a pytest log (its counts).
    local name status seconds last
    {
        printf '%-12s %-24s %8s  %s\n' step status seconds detail
        for name in "$@"; do
            if [[ -f "$out/$name.status" ]]; then
                IFS='|' read -r status seconds <"$out/$name.status"
            else
                status="not run"
                seconds=-
            fi
            last=""
            [[ -f "$out/$name.log" ]] && last=$(grep -E "passed|failed|error" "$out/$name.log" | tail -1)
            printf '%-12s %-24s %8s  %s\n' "$name" "$status" "$seconds" "${last:0:100}"
        done
    } | tee "$out/summary.txt"
}

# 1. What an offline CUDA image may lack, in one line, before anything runs (find_spec imports nothing).
run_step preflight "$PREFLIGHT_S" "$PYTHON" -c '
import importlib.util, sys
pairs = [entry.split("=") for entry in sys.argv[1:]]
missing = sorted({package for module, package in pairs if importlib.util.find_spec(module) is None})
if missing:
    sys.exit("missing: " + ", ".join(missing) + " (pip install them; offline, see docs/tests.md)")
' "${REQUIRED[@]}"
if [[ $(cut -d'|' -f1 "$out/preflight.status") != passed ]]; then
    cat "$out/preflight.log"
    exit 2
fi
if ! nvidia-smi -L >"$out/gpus.txt" 2>&1 || [[ ! -s "$out/gpus.txt" ]]; then
    echo "no GPU: nvidia-smi -L lists none ($(head -1 "$out/gpus.txt"))"
    exit 2
fi
cat "$out/gpus.txt"

# 2. Correctness, side by side on the machine's cores: the GPU tests (slow ones included) and the fast suite.
run_step gpu_tests "$TESTS_S" "$PYTHON" -m pytest "${PYTEST[@]}" -m gpu -n 4 &
run_step fast_suite "$TESTS_S" "$PYTHON" -m pytest "${PYTEST[@]}" -m "not slow and not gpu" -n 10 &
wait

# 3. Timing, alone: nothing else runs beside it.
run_step benchmark "$BENCHMARK_S" "$PYTHON" scripts/benchmark.py "${BENCHMARK[@]}" --out "$out/benchmark"
[[ -f "$out/benchmark/benchmark.md" ]] && cat "$out/benchmark/benchmark.md"

echo
summary preflight gpu_tests fast_suite benchmark
! grep -qv '^passed|' "$out"/*.status
