"""What plain TCP between processes of this host can carry, and what it costs in CPU.

The bound under every loader that ships chunks over a network: S sending
processes, each confined to its own core, stream chunk-sized buffers over raw
loopback TCP sockets (``sendall`` / ``recv_into`` a preallocated buffer: no
framing, no serialisation, no copy beyond the kernel's) to R receiving
processes, each on its own core; sender ``i`` talks to receiver ``i mod R``.
Per (S, R): the aggregate bytes/s, and the CPU seconds per GB each side spent
(``resource.getrusage`` in the child, user + system), from which a loader's
rate follows: a loader that needs ``a`` core-seconds per GB to load and ``b``
to send delivers at most ``1 / (a + b)`` GB/s per core.

    # device (H200): pairs up to 8 senders into 1, 2, 4 receivers
    python benchmarks/tcp_ceiling.py --senders 1,2,4,8 --receivers 1,2,4 \\
        --output benchmarks/results/tcp_ceiling-h200.json
    # dev box
    python benchmarks/tcp_ceiling.py --senders 1 --receivers 1 --chunks 8 \\
        --output /tmp/tcp_ceiling-devbox.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np
from common import environment, write_json

SCHEMA = "rh-dask/bench/tcp-ceiling/1"


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sender(port: int, core: int, nbytes: int, chunks: int, out: Any) -> None:
    os.sched_setaffinity(0, {core})
    block = np.ones(nbytes, np.uint8)
    view = memoryview(block)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cpu = _cpu_seconds()
        for _ in range(chunks):
            sock.sendall(view)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the receiver's close: every byte has arrived
        out.send(_cpu_seconds() - cpu)


def _receiver(listener: socket.socket, core: int, peers: int, nbytes: int, out: Any) -> None:
    os.sched_setaffinity(0, {core})
    buffer = np.empty(nbytes, np.uint8)
    view = memoryview(buffer)
    conns = [listener.accept()[0] for _ in range(peers)]
    cpu = _cpu_seconds()
    start = time.perf_counter()
    received = 0
    # One connection at a time, chunk by chunk, round robin: every sender keeps
    # its socket buffer full while the receiver drains another.
    live = list(conns)
    while live:
        for conn in list(live):
            got = 0
            while got < nbytes:
                n = conn.recv_into(view[got:], nbytes - got)
                if n == 0:
                    break
                got += n
            received += got
            if got < nbytes:
                live.remove(conn)
                conn.close()
    out.send((received, time.perf_counter() - start, _cpu_seconds() - cpu))


def measure(senders: int, receivers: int, nbytes: int, chunks: int, cores: list[int]) -> dict:
    """One timed transfer: ``senders`` processes into ``receivers`` processes."""
    if senders + receivers > len(cores):
        raise SystemExit(f"{senders}+{receivers} processes need more than {len(cores)} cores")
    ctx = mp.get_context("fork")
    listeners, procs, pipes = [], [], []
    for r in range(receivers):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(senders)
        listeners.append(listener)
        peers = len(range(r, senders, receivers))
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(listener, cores[r], peers, nbytes, there))
        procs.append(proc)
        pipes.append(("receiver", here))
    for s in range(senders):
        port = listeners[s % receivers].getsockname()[1]
        here, there = ctx.Pipe()
        core = cores[receivers + s]
        procs.append(ctx.Process(target=_sender, args=(port, core, nbytes, chunks, there)))
        pipes.append(("sender", here))
    for proc in procs:
        proc.start()
    results = [(role, pipe.recv()) for role, pipe in pipes]
    for proc in procs:
        proc.join()
    for listener in listeners:
        listener.close()
    received = [value for role, value in results if role == "receiver"]
    sent_cpu = [value for role, value in results if role == "sender"]
    total = sum(r[0] for r in received)
    wall = max(r[1] for r in received)
    gb = total / 1e9
    return {
        "senders": senders,
        "receivers": receivers,
        "bytes": total,
        "wall_seconds": wall,
        "gb_per_second": gb / wall,
        "per_receiver_gb_per_second": [r[0] / 1e9 / r[1] for r in received],
        "sender_cpu_seconds_per_gb": sum(sent_cpu) / gb,
        "receiver_cpu_seconds_per_gb": sum(r[2] for r in received) / gb,
    }


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--senders", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--receivers", type=ints, default=[1, 2, 4])
    p.add_argument("--chunk-rows", type=int, default=262_144)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--chunks", type=int, default=24, help="chunks per sender")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    nbytes = args.chunk_rows * (args.features + 1) * 4
    cores = sorted(os.sched_getaffinity(0))
    runs = []
    for r in args.receivers:
        for s in args.senders:
            if s < r or s + r > len(cores):
                continue
            repeats = [measure(s, r, nbytes, args.chunks, cores) for _ in range(args.repeats)]
            best = sorted(repeats, key=lambda x: x["gb_per_second"])[len(repeats) // 2]
            best["gb_per_second_runs"] = [x["gb_per_second"] for x in repeats]
            best["gb_per_second_median"] = statistics.median(best["gb_per_second_runs"])
            runs.append(best)
            print(
                f"S={s} R={r}: {best['gb_per_second_median']:.2f} GB/s, cpu s/GB "
                f"send {best['sender_cpu_seconds_per_gb']:.3f} "
                f"recv {best['receiver_cpu_seconds_per_gb']:.3f}",
                flush=True,
            )
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": {**vars(args), "chunk_bytes": nbytes},
        "cpus": cores,
        "results": runs,
    }
    print(write_json(args.output, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
