#!/usr/bin/env bash
# Start this node's share of a (multi-node) DDP run with torchrun: run the same command on every node, changing
# only the node rank. Settings come from flags or from the environment variables named below (flags win):
#
#   --nnodes N            NNODES           number of nodes (default 1); must equal trainer.num_nodes
#   --nproc_per_node P    NPROC_PER_NODE   processes on this node, one per device (default 1); = trainer.devices
#   --node_rank R         NODE_RANK        this node's rank, 0 .. N-1 (default 0)
#   --master_addr A       MASTER_ADDR      address of node 0, reachable from every node (default 127.0.0.1)
#   --master_port P       MASTER_PORT      a free TCP port on node 0 (default 29500)
#   --max_restarts K      MAX_RESTARTS     restart the workers up to K times when one fails (default 0)
#   --run_id ID           RUN_ID           the run's id, the same on every node: its folder is
#                                          lightning_logs/torchrun-ID/ and a restart continues from its newest
#                                          checkpoint (default: SLURM_JOB_ID, else a new id on one node, else none)
#
# Dashes work too (--nproc-per-node), as do --flag=value and --flag value. Everything after these flags (or
# after `--`) goes to `python -m template`, for example on node 1 of 2, with node 0 at 10.0.0.1:
#
#   scripts/torchrun.sh --nnodes 2 --nproc_per_node 4 --node_rank 1 --master_addr 10.0.0.1 \
#       fit --config configs/default.yaml --config configs/multinode.yaml
#
# PYTHON picks the interpreter (default: python).
set -euo pipefail

PACKAGE=template
nnodes=${NNODES:-1}
nproc_per_node=${NPROC_PER_NODE:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
max_restarts=${MAX_RESTARTS:-0}
run_id=${RUN_ID:-${SLURM_JOB_ID:-}}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit "$1"
}

missing_value() {
    echo "error: $1 needs a value, e.g. $1=2; see scripts/torchrun.sh --help" >&2
    exit 2
}

while (($#)); do
    flag=${1%%=*}
    case $flag in
    --nnodes | --nproc_per_node | --nproc-per-node | --node_rank | --node-rank | \
        --master_addr | --master-addr | --master_port | --master-port | --max_restarts | --max-restarts | \
        --run_id | --run-id)
        if [[ $1 == *=* ]]; then
            value=${1#*=}
            shift
        else
            (($# >= 2)) || missing_value "$flag"
            value=$2
            shift 2
        fi
        [[ -n $value ]] || missing_value "$flag"
        case $flag in
        --nnodes) nnodes=$value ;;
        --nproc_per_node | --nproc-per-node) nproc_per_node=$value ;;
        --node_rank | --node-rank) node_rank=$value ;;
        --master_addr | --master-addr) master_addr=$value ;;
        --master_port | --master-port) master_port=$value ;;
        --max_restarts | --max-restarts) max_restarts=$value ;;
        --run_id | --run-id) run_id=$value ;;
        esac
        ;;
    -h | --help) usage 0 ;;
    --)
        shift
        break
        ;;
    *) break ;;
    esac
done

for name in nnodes nproc_per_node node_rank master_port max_restarts; do
    if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
        echo "error: $name must be a whole number, got '${!name}'; see scripts/torchrun.sh --help" >&2
        exit 2
    fi
done
if ((node_rank >= nnodes)); then
    echo "error: node_rank $node_rank is out of range for $nnodes node(s); use 0 .. $((nnodes - 1))" >&2
    exit 2
fi

if [[ -z $run_id && $nnodes == 1 ]]; then
    # One node: an id of its own, so that torchrun's restarts of this launch continue the same run folder.
    run_id="$(date -u +%Y%m%d-%H%M%S)-$$"
fi
if [[ -n $run_id && ! $run_id =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
    echo "error: run_id '$run_id' may hold only letters, digits, '.', '_' and '-'; see scripts/torchrun.sh --help" >&2
    exit 2
fi

# torch.distributed.run is torchrun, taken from the same interpreter as the training code. The run id reaches the
# workers as TORCHELASTIC_RUN_ID, which names the run folder; without one ("none") each launch gets a new folder.
exec "${PYTHON:-python}" -m torch.distributed.run \
    --nnodes="$nnodes" \
    --nproc_per_node="$nproc_per_node" \
    --node_rank="$node_rank" \
    --master_addr="$master_addr" \
    --master_port="$master_port" \
    --max_restarts="$max_restarts" \
    --rdzv_id="${run_id:-none}" \
    -m "$PACKAGE" "$@"
