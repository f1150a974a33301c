"""Inputs, chunk functions and a client script for the fault-injection tests.

The chunk functions run inside Dask's worker processes (or the engine's
feeder threads there), so they live in a module the workers import by name
rather than in the test module. A process "dies" the way a preempted host or
the kernel's OOM killer ends it: ``SIGKILL`` of its own process, nothing
flushed, nothing cleaned up.

Run as a client (the test of a killed client process starts it in a
subprocess)::

    python -c "import faults_helpers, sys; faults_helpers.client_main(sys.argv[1:])" \\
        SCHEDULER_ADDRESS CHECKPOINT_DIR
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Chunks of every fault test's input, and rows and features of each.
N_CHUNKS = 12
CHUNK_ROWS = 200
N_FEATURES = 5

#: The estimator of the killed-client test, in its subprocess and in the resuming test.
RESUME_PARAMS: dict[str, Any] = {
    "loader": "actor",
    "lookahead": 2,
    "checkpoint_every": 1,
    "progress": False,
}

#: Seconds each chunk of the killed-client test takes to load.
SLOW_SECONDS = 0.4


def arrays(
    n_chunks: int = N_CHUNKS, seed: int = 13, d: int = N_FEATURES
) -> tuple[np.ndarray, np.ndarray]:
    """A heavy-tailed linear stream of ``n_chunks * CHUNK_ROWS`` rows (float64)."""
    rng = np.random.default_rng(seed)
    n = n_chunks * CHUNK_ROWS
    X = rng.normal(size=(n, d))
    y = X @ rng.normal(size=d) + 0.5 + rng.standard_t(2, size=n)
    return X, y


def collection(X: np.ndarray, y: np.ndarray, fn: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    """Dask arrays of ``CHUNK_ROWS``-row chunks; ``fn(block, **kwargs)`` maps X's chunks."""
    import dask.array as da

    Xd = da.from_array(X, chunks=(CHUNK_ROWS, X.shape[1]))
    if fn is not None:
        # meta given: dask never calls fn in this process to infer it.
        Xd = Xd.map_blocks(fn, dtype=X.dtype, meta=np.empty((0, 0), X.dtype), **kwargs)
    return Xd, da.from_array(y, chunks=CHUNK_ROWS)


def _claim(marker: str) -> bool:
    """Create ``marker``; False when it exists (the first caller wins, across processes)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def kills(log: str | os.PathLike[str]) -> list[tuple[int, float]]:
    """``(pid, time)`` of every kill :func:`die_at` logged, in order."""
    path = Path(log)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        pid, when = line.split()
        out.append((int(pid), float(when)))
    return out


def die_at(
    block: np.ndarray,
    *,
    at: int | None = None,
    marker: str | None = None,
    log: str | None = None,
    limit: int | None = None,
    spare: tuple[int, ...] = (),
    delay: float = 0.0,
    block_info: dict | None = None,
) -> np.ndarray:
    """Chunk function: the process loading chunk ``at`` SIGKILLs itself.

    Parameters
    ----------
    at : int or None
        The chunk whose loading kills; None: any chunk.
    marker : str or None
        A file claimed before dying: only its first claimant dies (fires once).
    log : str or None
        A file that gets ``"pid time"`` appended just before each kill.
    limit : int or None
        With ``log``: no more kills once the log holds this many.
    spare : tuple of int
        Processes that never die (the test's own, the engine's worker).
    delay : float
        Seconds to wait before dying (the engine meanwhile consumes what it
        has, and its checkpoints reach the client).
    """
    if block_info is None or os.getpid() in spare:
        return block
    if at is not None and block_info[0]["chunk-location"][0] != at:
        return block
    if log is not None and limit is not None and len(kills(log)) >= limit:
        return block
    if marker is not None and not _claim(marker):
        return block
    time.sleep(delay)
    if log is not None:
        with open(log, "a") as fh:
            fh.write(f"{os.getpid()} {time.time()!r}\n")
            fh.flush()
            os.fsync(fh.fileno())
    os.kill(os.getpid(), signal.SIGKILL)
    return block  # not reached


def slow_chunk(block: np.ndarray, *, seconds: float) -> np.ndarray:
    """Chunk function: loading takes ``seconds`` (the walk lasts long enough to be hit)."""
    time.sleep(seconds)
    return block


def slow_collection() -> tuple[Any, Any]:
    """The killed-client test's input, built alike in the subprocess and in the test."""
    X, y = arrays(seed=31)
    return collection(X, y, slow_chunk, seconds=SLOW_SECONDS)


def client_main(argv: list[str]) -> int:
    """Fit :func:`slow_collection` on the scheduler ``argv[0]``, checkpointing to ``argv[1]``."""
    from distributed import Client

    from rh_dask import RenewableHuberRegressor

    address, directory = argv
    with Client(address, set_as_default=True, timeout=30):
        Xd, yd = slow_collection()
        print("fitting", flush=True)
        RenewableHuberRegressor(checkpoint_dir=directory, **RESUME_PARAMS).fit(Xd, yd)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(client_main(sys.argv[1:]))
