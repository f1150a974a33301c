"""What a relay pays to write a chunk into a fresh ring slot, and into a kept ring's slot.

The relay ring (``rh_dask.distributed.ring``) gives each slot its memory at
the first write (``posix_fallocate``, then its pages faulted in). With
``rh-dask.relay.keep-ring`` a clean stream leaves its ring with the parked
engine and the next stream takes it (:meth:`ChunkRing.renew`): its relays
attach afresh by name, so their page tables are new but the memory is
allocated already. This measures both, no Dask: R writer processes (the
relays), each writing the chunks of its slots (slot ``s`` by writer
``s mod R``) at once, as a stream's first ``n_slots`` chunks arrive:

* ``fresh``: a new ring, new writers (every stream without keep-ring);
* ``renewed``: the same ring renewed, new writers attached by name (the
  next stream with keep-ring);
* ``warm``: the renewed ring's writers writing the same slots again (a
  slot's later chunks within one stream).

Records each chunk's write time (milliseconds) per phase, median of
``--repeats`` rounds, and the wall time of each phase.

    python benchmarks/ring_reuse.py --slots 8 --slot-mib 95 --writers 4 \\
        --output benchmarks/results/ring_reuse-devbox.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np
from common import environment, summarize, write_json

from rh_dask.distributed.ring import ChunkRing, RingWriter, default_directory

SCHEMA = "rh-dask/bench/ring-reuse/1"


def _writer(spec: Any, slots: list[int], rows: int, cols: int, start: int, out: Any) -> None:
    """Attach to the ring, write one chunk into each of ``slots`` (twice: fresh/renewed, warm)."""
    writer = RingWriter.attach(spec)
    X = np.random.default_rng(start).normal(size=(rows, cols)).astype("float32")
    y = X[:, 0].copy()
    times: dict[str, list[float]] = {"first": [], "again": []}
    try:
        for phase, offset in (("first", 0), ("again", spec.n_slots)):
            for slot in slots:
                index = start + slot + offset
                while int(writer._mapped.owner[slot]) != index:  # the engine releases it
                    time.sleep(0.0005)
                t0 = time.perf_counter()
                note = writer.write(index, [X, y, None])
                times[phase].append(time.perf_counter() - t0)
                assert note is not None and note.overflow is None
            out.put(("done", phase))
    finally:
        writer.close()
        out.put(("times", times))


def _round(ring: ChunkRing, writers: int, rows: int, cols: int) -> dict[str, Any]:
    """One stream's first 2 × n_slots chunks through ``writers`` fresh processes."""
    spec = ring.spec
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    plan = [[s for s in range(spec.n_slots) if s % writers == w] for w in range(writers)]
    procs = [
        ctx.Process(target=_writer, args=(spec, slots, rows, cols, spec.start, out))
        for slots in plan
    ]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    # The first pass: every slot's first chunk; then free them all for the second.
    done = 0
    while done < writers:
        kind, _ = out.get(timeout=300)
        done += kind == "done"
    first_wall = time.perf_counter() - t0
    for i in range(spec.start, spec.start + spec.n_slots):
        ring.release(i)
    t1 = time.perf_counter()
    times: dict[str, list[float]] = {"first": [], "again": []}
    finished = 0
    while finished < writers:
        kind, value = out.get(timeout=300)
        if kind == "times":
            finished += 1
            for phase, values in value.items():
                times[phase] += values
    again_wall = time.perf_counter() - t1
    for p in procs:
        p.join(60)
    for i in range(spec.start + spec.n_slots, spec.start + 2 * spec.n_slots):
        ring.release(i)
    return {
        "first_ms": [t * 1e3 for t in times["first"]],
        "again_ms": [t * 1e3 for t in times["again"]],
        "first_wall_seconds": first_wall,
        "again_wall_seconds": again_wall,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--slot-mib", type=float, default=95.0, help="chunk size (X float32 and y)")
    p.add_argument("--cols", type=int, default=90)
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--directory", default=None, help="default: /dev/shm where it exists")
    p.add_argument("--output", default="benchmarks/results/ring_reuse.json")
    args = p.parse_args(argv)
    rows = int(args.slot_mib * 2**20 // ((args.cols + 1) * 4))
    slot_bytes = rows * (args.cols + 1) * 4 + 3 * 64
    directory = args.directory or default_directory()
    phases: dict[str, list[dict[str, Any]]] = {"fresh": [], "renewed": []}
    for _ in range(args.repeats):
        ring = ChunkRing.create(directory, args.slots, slot_bytes, keep=True)
        try:
            phases["fresh"].append(_round(ring, args.writers, rows, args.cols))
            assert ring.renew(start=0) is not None
            phases["renewed"].append(_round(ring, args.writers, rows, args.cols))
        finally:
            ring.close()
    summary = {
        "fresh_first_write_ms": summarize([t for r in phases["fresh"] for t in r["first_ms"]]),
        "renewed_first_write_ms": summarize([t for r in phases["renewed"] for t in r["first_ms"]]),
        "warm_write_ms": summarize(
            [t for name in phases for r in phases[name] for t in r["again_ms"]]
        ),
        "fresh_first_wall_seconds": summarize([r["first_wall_seconds"] for r in phases["fresh"]]),
        "renewed_first_wall_seconds": summarize(
            [r["first_wall_seconds"] for r in phases["renewed"]]
        ),
    }
    payload = {
        "schema": SCHEMA,
        "environment": environment(),
        "arguments": vars(args),
        "chunk": {"rows": rows, "cols": args.cols, "slot_bytes": slot_bytes},
        "summary": summary,
        "rounds": phases,
    }
    write_json(args.output, payload)
    for name, value in summary.items():
        low, high = value["min"], value["max"]
        print(f"{name}: median {value['median']:.3f} min {low:.3f} max {high:.3f}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
