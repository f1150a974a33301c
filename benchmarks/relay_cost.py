"""CPU seconds per GB of each role on the relay path, with and without heap chunks.

A cluster of three worker processes under nannies (one thread each): a
sender holding chunk-sized ``LoadedChunk`` items, a relay (``relay=1``) and
the engine's worker, which holds a ring and a counting receiver
(``scale_out.relay_ceiling``). Each round relays ``--chunks`` chunks; the
relay's per-thread CPU time is read with psutil before and after, so the
cost of the relay's event loop (receiving over Dask's comm) and of its task
thread (the copy into the ring) are told apart. The first rounds pay the
imports and the growth of the heap: the last rounds are the steady state.
Run once with ``--heap off`` and once with ``--heap on`` (the relay's
``rh-dask.relay.heap-for-chunks``, set here directly on every worker).

    python benchmarks/relay_cost.py --heap off --output relay_cost-off.json
    python benchmarks/relay_cost.py --heap on --output relay_cost-on.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from common import environment, package_versions, write_json
from scale_out import relay_ceiling

SCHEMA = "rh-dask/bench/relay-cost/1"


def _thread_cpu() -> dict[str, float]:
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    return {
        names.get(t.id, str(t.id)): t.user_time + t.system_time for t in psutil.Process().threads()
    }


def _heap_on() -> bool:
    from rh_dask.distributed import memory

    return memory.heap_for_chunks() is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heap", choices=["on", "off"], default="on")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--chunks", type=int, default=12)
    p.add_argument("--chunk-rows", type=int, default=262_144)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--output", default="benchmarks/results/relay_cost.json")
    args = p.parse_args(argv)

    from distributed import Client, Nanny, Scheduler, SpecCluster

    def worker(name: str, resources: dict[str, float]) -> dict[str, Any]:
        return {"cls": Nanny, "options": {"nthreads": 1, "resources": resources, "name": name}}

    workers = {
        "sender": worker("sender", {}),
        "relay": worker("relay", {"relay": 1}),
        "engine": worker("engine", {"GPU": 1}),
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    rounds = []
    cols = args.features + 1
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        info = client.scheduler_info(n_workers=-1)["workers"]
        by = {w["name"]: address for address, w in info.items()}
        if args.heap == "on":
            client.run(_heap_on)
        for index in range(args.rounds):
            before = client.run(_thread_cpu, workers=[by["relay"]])[by["relay"]]
            start = time.perf_counter()
            ceiling = relay_ceiling(
                client,
                [by["sender"]],
                [by["relay"]],
                by["engine"],
                args.chunk_rows,
                cols,
                "float32",
                args.chunks,
                args.slots,
            )
            wall = time.perf_counter() - start
            after = client.run(_thread_cpu, workers=[by["relay"]])[by["relay"]]
            gb = ceiling["bytes"] / 1e9
            spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
            loop = spent.get("MainThread", 0.0)
            tasks = sum(v for k, v in spent.items() if "Dask-Default-Threads" in k)
            rounds.append(
                {
                    "round": index,
                    "wall_seconds": wall,
                    "gb": gb,
                    "gb_per_second": ceiling["gb_per_second"],
                    "relay_event_loop_cpu_seconds_per_gb": loop / gb,
                    "relay_task_threads_cpu_seconds_per_gb": tasks / gb,
                    "relay_threads_cpu_seconds": spent,
                }
            )
            print(
                f"round {index}: {ceiling['gb_per_second']:.2f} GB/s, relay event loop "
                f"{loop / gb:.3f} s/GB, task thread {tasks / gb:.3f} s/GB",
                flush=True,
            )
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "versions": package_versions(["numpy", "dask", "distributed", "psutil"]),
        "arguments": vars(args),
        "chunk_bytes": args.chunk_rows * cols * 4,
        "rounds": rounds,
        "steady_state": rounds[-1],
    }
    print(f"wrote {write_json(args.output, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
