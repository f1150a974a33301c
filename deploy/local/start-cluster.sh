#!/usr/bin/env bash
# Start a one-machine rh-dask cluster: a scheduler, one GPU worker per GPU
# (`dask cuda worker --resources GPU=1`) and, optionally, CPU loader workers.
# Runs in the foreground; Ctrl-C (or SIGTERM) stops everything it started.
#
#   deploy/local/start-cluster.sh                      # all GPUs, no CPU workers
#   deploy/local/start-cluster.sh --cpu-workers 2      # plus 2 CPU loader workers
#   rh-dask fit --scheduler tcp://127.0.0.1:8786 ...   # from another shell
#   deploy/local/start-cluster.sh --host 0.0.0.0 --tls-dir certs   # other machines: TLS
#
# Listening beyond 127.0.0.1 needs --tls-dir DIR: mutual TLS with the
# credentials of `rh-dask certs DIR` (made there when DIR has none), and
# plain connections refused. The dashboard stays on 127.0.0.1 unless its
# address names another host.
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
TLS_DIR=""

usage() {
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    cat <<USAGE

options:
  --host HOST              address to listen on (default: $HOST; 0.0.0.0 for other
                           machines, which needs --tls-dir)
  --tls-dir DIR            mutual TLS with the credentials in DIR (rh-dask certs DIR,
                           run here when DIR has none); plain TCP is refused
  --port PORT              scheduler port (default: $PORT)
  --dashboard ADDRESS      scheduler dashboard, e.g. :8787 (on 127.0.0.1 unless ADDRESS
                           names a host, e.g. 0.0.0.0:8787; default: none)
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
        --tls-dir) TLS_DIR="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "start-cluster.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
    esac
done

case "$HOST" in
    127.0.0.1|localhost|::1) ;;
    *) if [[ -z "$TLS_DIR" ]]; then
           echo "start-cluster.sh: --host $HOST listens beyond this machine: add --tls-dir DIR" \
               "(mutual TLS; rh-dask certs DIR makes the credentials)" >&2
           exit 2
       fi ;;
esac
# A dashboard address without a host would listen on every interface.
[[ "$DASHBOARD" == :* ]] && DASHBOARD="127.0.0.1$DASHBOARD"

PROTOCOL=tcp
scheduler_tls=()
worker_tls=()
connect_tls=""
if [[ -n "$TLS_DIR" ]]; then
    rh-dask certs "$TLS_DIR" --keep --host "$(hostname)" >/dev/null
    PROTOCOL=tls
    scheduler_tls=(--protocol tls --tls-ca-file "$TLS_DIR/ca.pem"
                   --tls-cert "$TLS_DIR/scheduler.pem" --tls-key "$TLS_DIR/scheduler-key.pem")
    worker_tls=(--tls-ca-file "$TLS_DIR/ca.pem"
                --tls-cert "$TLS_DIR/worker.pem" --tls-key "$TLS_DIR/worker-key.pem")
    connect_tls=" --tls-dir $TLS_DIR"
    # Scheduler and workers refuse any connection that is not TLS.
    export DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION=True
fi
ADDRESS="$PROTOCOL://$HOST:$PORT"
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

scheduler_args=(--host "$HOST" --port "$PORT" "${scheduler_tls[@]}")
if [[ -n "$DASHBOARD" ]]; then
    scheduler_args+=(--dashboard-address "$DASHBOARD")
else
    # Its HTTP server (health, metrics) still starts: on 127.0.0.1, a free port.
    scheduler_args+=(--no-dashboard --dashboard-address 127.0.0.1:0)
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

worker_common=(--host "$HOST" --no-dashboard --local-directory "$LOCAL_DIR" "${worker_tls[@]}")
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
echo "  connect: rh-dask fit --scheduler $ADDRESS$connect_tls ...   or   Client(\"$ADDRESS\")"
# Stop everything as soon as any process dies, rather than run half a cluster.
wait -n
echo "start-cluster.sh: a cluster process exited; stopping the rest" >&2
exit 1
