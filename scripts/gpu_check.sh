#!/usr/bin/env bash
# The GPU paths on one real GPU, in order, each resuming the previous run's last checkpoint (--ckpt_path last):
# one device, strategy dp over [0], strategy ddp with one process over NCCL, bf16-mixed, devices free:1 under ddp,
# strategy fsdp (bf16, NCCL) twice, then the one-line refusal of a free-memory floor no GPU meets. CI has no GPU;
# run this by hand after
#   pip install "torch==<a CUDA build>" -e ".[dev,gpu]"
# Every step is bounded by `timeout`; the scratch folder is printed and kept for inspection. PYTHON picks the
# interpreter (default: python).
set -euo pipefail

PACKAGE=template
PYTHON=${PYTHON:-python}
work=$(mktemp -d)
epochs=0
echo "scratch folder: $work"

step() {
    # step NAME EXTRA_ARGS...: train 2 more epochs from the newest checkpoint and fail on any error.
    local name=$1
    shift
    epochs=$((epochs + 2))
    local resume=()
    [[ $epochs -gt 2 ]] && resume=(--ckpt_path last)
    echo "== $name (to epoch $epochs)"
    timeout 600 "$PYTHON" -m "$PACKAGE" fit "$@" --trainer.max_epochs=$epochs --trainer.default_root_dir="$work" \
        "${resume[@]}" >"$work/$name.log" 2>&1 || { tail -30 "$work/$name.log"; echo "FAILED: $name"; exit 1; }
    if grep -q "Tensor Cores" "$work/$name.log"; then
        echo "FAILED: $name: Lightning still warns about float32 matmul precision"
        exit 1
    fi
    grep -E "GPU available|distributed_backend|training on GPU|Best checkpoint" "$work/$name.log" || true
}

step single --config configs/default.yaml --trainer.accelerator=gpu
step dp --config configs/dp.yaml "--trainer.devices=[0]"
step ddp_nccl --config configs/ddp.yaml "--trainer.devices=[0]"
grep -q "distributed_backend=nccl" "$work/ddp_nccl.log" || { echo "FAILED: ddp did not use NCCL"; exit 1; }
step bf16 --config configs/bf16.yaml --trainer.accelerator=gpu
grep -q "bf16" "$work/bf16.log" || { echo "FAILED: bf16 run does not mention bf16"; exit 1; }
step free_ddp --config configs/ddp.yaml --trainer.devices=free:1
grep -q "training on GPU(s) \[0\]" "$work/free_ddp.log" || { echo "FAILED: free:1 did not report its pick"; exit 1; }
# The whole checkpoint of the ddp run loads into the shards; the next step resumes from fsdp's sharded folder.
step fsdp --config configs/fsdp.yaml "--trainer.devices=[0]"
step fsdp_resumed --config configs/fsdp.yaml "--trainer.devices=[0]"
grep -q "distributed_backend=nccl" "$work/fsdp.log" || { echo "FAILED: fsdp did not use NCCL"; exit 1; }
grep -q "fsdp: sharded" "$work/fsdp.log" || { echo "FAILED: fsdp did not announce its sharding"; exit 1; }

echo "== refusal: free:1,min=100000GiB"
set +e
timeout 120 "$PYTHON" -m "$PACKAGE" fit --config configs/ddp.yaml --trainer.devices=free:1,min=100000GiB \
    --trainer.default_root_dir="$work/refused" >"$work/refused.log" 2>&1
code=$?
set -e
if [[ $code -ne 2 ]] || [[ $(grep -c "^error:" "$work/refused.log") -ne 1 ]] || grep -q Traceback "$work/refused.log"; then
    cat "$work/refused.log"
    echo "FAILED: expected exit 2 with one error line, got exit $code"
    exit 1
fi
grep "^error:" "$work/refused.log"
echo "all GPU checks passed ($work)"
