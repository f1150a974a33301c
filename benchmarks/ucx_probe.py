"""Bytes/s into one receiving worker over Dask's comm: TCP against UCX (distributed-ucxx).

For each protocol (``tcp``, ``ucxx``) a LocalCluster of one receiving worker
and ``max(--senders)`` sending workers (one thread each) is started on this
machine. For each number of senders and each buffer kind, the senders hold
``--chunks`` chunk-sized blocks (``--chunk-rows`` × ``--features + 1``
float32) and the receiver runs one task per block depending on it
(``scale_out.comm_ceiling``: the blocks exist before the clock starts, each
is released as soon as its task is done). Buffer kinds: ``host`` (NumPy
arrays) and ``device`` (CuPy arrays on the GPU; only where CuPy sees one:
with UCX they may travel by CUDA copies, with TCP through host memory).

UCX needs ``distributed-ucxx`` (and ``ucxx``, ``libucx``); the probe stops at
once, saying so, when a UCX protocol is asked for and they do not import.

    # device (H200), with the wheels of .whl-ucx installed
    python benchmarks/ucx_probe.py --protocols tcp,ucxx --buffers host,device \\
        --output benchmarks/results/ucx_probe-h200.json
    # dev box: TCP only, small blocks
    python benchmarks/ucx_probe.py --protocols tcp --senders 1,2 --chunk-rows 16384 \\
        --chunks 8 --output /tmp/ucx_probe-devbox.json
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
from common import environment, package_versions, write_json
from distributed_fit import parse_settings
from scale_out import comm_ceiling

SCHEMA = "rh-dask/bench/ucx-probe/1"
UCX_PROTOCOLS = ("ucx", "ucxx")
BENCH_DIR = Path(__file__).resolve().parent


def require_ucx(protocol: str) -> dict[str, str | None]:
    """Import distributed-ucxx and ucxx, or stop with what is missing; their versions."""
    try:
        import distributed_ucxx  # noqa: F401 (registers the "ucx"/"ucxx" comm backends)
        import ucxx  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"protocol {protocol!r} needs distributed-ucxx and ucxx, which do not import "
            f"here ({type(exc).__name__}: {exc}); install distributed-ucxx-cu13 with its "
            "dependencies (the wheels of .whl-ucx/) or run --protocols tcp"
        ) from exc
    return package_versions(
        ["distributed-ucxx-cu13", "ucxx-cu13", "libucx-cu13", "libucxx-cu13", "rmm-cu13"]
    )


def device_available() -> str | None:
    """Why device buffers cannot be probed here, or None when CuPy sees a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU"
    except Exception as exc:  # ImportError, or a CUDA runtime without a device
        return f"no CuPy GPU: {type(exc).__name__}: {exc}"
    return None


def _device_block(rows: int, cols: int, dtype: str, value: int) -> Any:
    import cupy

    return cupy.full((rows, cols), value, dtype=dtype)


def _host_block(rows: int, cols: int, dtype: str, value: int) -> np.ndarray:
    return np.full((rows, cols), value, dtype=dtype)


def probe(protocol: str, args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    """Every sender count and buffer kind over one protocol (a cluster of its own)."""
    from distributed import Client, LocalCluster

    senders = [int(s) for s in args.senders.split(",") if s]
    cluster = LocalCluster(
        protocol=protocol,
        host="127.0.0.1",
        n_workers=1 + max(senders),
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        memory_limit=0,
    )
    client = Client(cluster)
    out: dict[str, Any] = {
        "protocol": protocol,
        "scheduler": cluster.scheduler_address,
        "runs": [],
    }
    try:
        client.wait_for_workers(1 + max(senders), timeout=120)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        receiver, pool = workers[0], workers[1:]
        out["receiver"] = receiver
        cols = args.features + 1
        for kind in kinds:
            maker = _device_block if kind == "device" else _host_block
            for n in senders:
                run: dict[str, Any] = {"buffers": kind, "senders": n}
                try:
                    comm_ceiling(
                        client, pool[:n], receiver, args.chunk_rows, cols, "float32", 2, maker
                    )
                    samples = [
                        comm_ceiling(
                            client,
                            pool[:n],
                            receiver,
                            args.chunk_rows,
                            cols,
                            "float32",
                            args.chunks,
                            maker,
                        )
                        for _ in range(args.repeats)
                    ]
                    rates = sorted(s["gb_per_second"] for s in samples)
                    run.update(samples[0] | {"runs": samples})
                    run["gb_per_second"] = rates[len(rates) // 2]
                    run.pop("wall_seconds", None)
                except Exception as exc:  # keep the other runs
                    run["error"] = f"{type(exc).__name__}: {exc}"
                    run["trace"] = traceback.format_exc()
                out["runs"].append(run)
                print(protocol, kind, n, run.get("gb_per_second", run.get("error")), flush=True)
    finally:
        client.close()
        cluster.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--protocols", default="tcp,ucxx")
    p.add_argument("--buffers", default="host,device", help="host (NumPy), device (CuPy)")
    p.add_argument("--senders", default="1,2,4,8")
    p.add_argument("--chunk-rows", type=int, default=262_144)
    p.add_argument("--features", type=int, default=90)
    p.add_argument("--chunks", type=int, default=32, help="blocks per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements (median kept)")
    p.add_argument(
        "--ucx-config",
        default="",
        help="distributed-ucxx settings KEY=VALUE,... (e.g. cuda-copy=true,nvlink=true)",
    )
    p.add_argument("--output", default="benchmarks/results/ucx_probe.json")
    args = p.parse_args(argv)
    protocols = [s for s in args.protocols.split(",") if s]
    kinds = [s for s in args.buffers.split(",") if s]
    bad = set(kinds) - {"host", "device"}
    if bad:
        p.error(f"unknown buffers {sorted(bad)}; choose host, device")
    ucx_versions = None
    for protocol in protocols:
        if protocol in UCX_PROTOCOLS:
            ucx_versions = require_ucx(protocol)
    # The workers import this module's makers and scale_out's ceiling by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(BENCH_DIR.parent), str(BENCH_DIR), os.environ.get("PYTHONPATH", "")]
    )
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "ucx_packages": ucx_versions,
        "chunk_bytes": args.chunk_rows * (args.features + 1) * 4,
        "protocols": [],
    }
    no_device = device_available() if "device" in kinds else None
    if no_device:
        payload["device_buffers_skipped"] = no_device
        kinds = [k for k in kinds if k != "device"]
    ucx = {f"distributed-ucxx.{k}": v for k, v in parse_settings(args.ucx_config).items()}
    with dask.config.set(ucx):
        for protocol in protocols:
            payload["protocols"].append(probe(protocol, args, kinds))
            write_json(args.output, payload)
    write_json(args.output, payload)
    print(f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
