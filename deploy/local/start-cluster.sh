#!/usr/bin/env bash
# Start a one-machine rh-dask cluster: a scheduler, one GPU worker per GPU
# (`dask cuda worker --resources GPU=1`) and, optionally, CPU loader workers.
# Runs in the foreground; Ctrl-C (or SIGTERM) stops everything it started.
#
#   deploy/local/start-cluster.sh                      # all GPUs, no CPU workers
#   deploy/local/start-cluster.sh --cpu-workers 2      # plus 2 CPU loader workers
#   rh-dask fit --scheduler tcp://127.0.0.1:8786 ...   # from another shell
#
# --gpu-slots-on-cpu N starts N plain `dask worker --resources GPU=1` instead of
# dask-cuda workers: a rehearsal of the placement on a machine without a GPU
# (the tests use it with the NumPy engine). It does not make a GPU appear.
set -euo pipefail

HOST=127.0.0.1
PORT=8786
DASHBOARD=""          # e.g. :8787 (needs bokeh); empty: no dashboard
CPU_WORKERS=0
CPU_THREADS=2
GPU_THREADS=""        # threads per GPU worker (they load chunks); default: dask-cuda's
GPU_SLOTS_ON_CPU=0
SCHEDULER_FILE=""
LOCAL_DIR="${TMPDIR:-/tmp}"

usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
    cat <<USAGE

options:
  --host HOST              address to listen on (default: $HOST; 0.0.0.0 for other machines)
  --port PORT              scheduler port (default: $PORT)
  --dashboard ADDRESS      scheduler dashboard, e.g. :8787 (default: none)
  --cpu-workers N          CPU loader worker processes (default: $CPU_WORKERS)
  --cpu-threads N          threads per CPU worker (default: $CPU_THREADS)
  --gpu-threads N          threads per GPU worker (default: dask-cuda's)
  --gpu-slots-on-cpu N     rehearsal without GPUs: N CPU workers advertising GPU=1
  --scheduler-file PATH    also write the scheduler's address to PATH
  --local-directory PATH   worker scratch space (default: $LOCAL_DIR)
USAGE
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --host) HOST="$2"; shift 2 ;;
        --port) PORT="$2"; shift 2 ;;
        --dashboard) DASHBOARD="$2"; shift 2 ;;
        --cpu-workers) CPU_WORKERS="$2"; shift 2 ;;
        --cpu-threads) CPU_THREADS="$2"; shift 2 ;;
        --gpu-threads) GPU_THREADS="$2"; shift 2 ;;
        --gpu-slots-on-cpu) GPU_SLOTS_ON_CPU="$2"; shift 2 ;;
        --scheduler-file) SCHEDULER_FILE="$2"; shift 2 ;;
        --local-directory) LOCAL_DIR="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "start-cluster.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    esac
done

ADDRESS="tcp://$HOST:$PORT"
PIDS=()
stop() {
    trap - EXIT INT TERM
    # Workers first, so they do not spend their death timeout reconnecting.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        kill "${PIDS[i]}" 2>/dev/null || true
    done
    wait 2>/dev/null || true
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

scheduler_args=(--host "$HOST" --port "$PORT")
if [[ -n "$DASHBOARD" ]]; then
    scheduler_args+=(--dashboard-address "$DASHBOARD")
else
    scheduler_args+=(--no-dashboard)
fi
[[ -n "$SCHEDULER_FILE" ]] && scheduler_args+=(--scheduler-file "$SCHEDULER_FILE")
dask scheduler "${scheduler_args[@]}" &
PIDS+=($!)

# Wait for the scheduler to listen before starting workers.
python - "$HOST" "$PORT" <<'PY'
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    try:
        socket.create_connection((host, port), timeout=1).close()
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit("start-cluster.sh: the scheduler did not start listening within 60 s")
PY

worker_common=(--host "$HOST" --no-dashboard --local-directory "$LOCAL_DIR")
if [[ "$GPU_SLOTS_ON_CPU" -gt 0 ]]; then
    for ((i = 0; i < GPU_SLOTS_ON_CPU; i++)); do
        dask worker "$ADDRESS" "${worker_common[@]}" --name "gpu-slot-$i" \
            --nthreads "${GPU_THREADS:-2}" --resources GPU=1 &
        PIDS+=($!)
    done
else
    gpu_args=("${worker_common[@]}" --resources GPU=1)
    [[ -n "$GPU_THREADS" ]] && gpu_args+=(--nthreads "$GPU_THREADS")
    # One dask-cuda worker process per visible GPU, each advertising GPU=1.
    dask cuda worker "$ADDRESS" "${gpu_args[@]}" &
    PIDS+=($!)
fi
if [[ "$CPU_WORKERS" -gt 0 ]]; then
    for ((i = 0; i < CPU_WORKERS; i++)); do
        dask worker "$ADDRESS" "${worker_common[@]}" --name "cpu-$i" --nthreads "$CPU_THREADS" &
        PIDS+=($!)
    done
fi

echo "rh-dask cluster: scheduler at $ADDRESS (Ctrl-C stops it)"
echo "  connect: rh-dask fit --scheduler $ADDRESS ...   or   Client(\"$ADDRESS\")"
# Stop everything as soon as any process dies, rather than run half a cluster.
wait -n
echo "start-cluster.sh: a cluster process exited; stopping the rest" >&2
exit 1
