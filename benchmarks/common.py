"""Shared plumbing of the benchmarks: environment metadata, fingerprints, JSON output.

Every benchmark writes one schema-versioned JSON document holding the
hardware, the library versions, the shapes, every raw timing and the summary
statistics, so that results can be compared across runs and machines.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from rh_dask.engines.blas_threads import cpu_caches, usable_cores

#: The benchmark shapes of issue 3: name -> (rows, features, batch rows).
SHAPES: dict[str, tuple[int, int, int]] = {
    "latency": (4_096, 16, 4_096),
    "reference": (100_000, 90, 32_768),
    "wide": (16_384, 256, 4_096),
    "streaming": (1_000_000, 32, 65_536),
}

#: Issue 16's wide designs: d features, 4 batches of max(4d, 8192) rows (name -> as SHAPES).
WIDE_SHAPES: dict[str, tuple[int, int, int]] = {
    f"wide{d}": (4 * max(4 * d, 8_192), d, max(4 * d, 8_192)) for d in (512, 1024, 2048)
}


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """Installed versions of ``names`` (None where not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def blas_info() -> list[dict[str, Any]]:
    """BLAS/OpenMP libraries NumPy uses (threadpoolctl), when available."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keys = ("internal_api", "version", "num_threads", "architecture", "threading_layer")
    return [{k: info.get(k) for k in keys} for info in threadpool_info()]


def gpu_info() -> dict[str, Any] | None:
    """Name, driver, CUDA and CuPy versions of the current GPU, or None."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        device = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(device.id)
        name = props["name"]
        return {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": device.compute_capability,
            "multiprocessors": int(props["multiProcessorCount"]),
            "memory_bytes": int(props["totalGlobalMem"]),
            "driver_version": cupy.cuda.runtime.driverGetVersion(),
            "runtime_version": cupy.cuda.runtime.runtimeGetVersion(),
            "cupy_version": cupy.__version__,
        }
    except Exception as exc:  # a broken driver is worth recording, not fatal
        return {"error": repr(exc)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_revision() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_tree_clean() -> bool | None:
    """Whether the tracked files are those of :func:`git_revision` (None: no git).

    A copy of a working tree run elsewhere may carry a stale ``.git``: its
    revision then names other code, and this says so.
    """
    try:
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return not changed.strip()


#: The code a result depends on, digested by :func:`source_digest`.
SOURCE_DIRS = ("rh_dask", "gpu_engine", "benchmarks")


def source_digest(root: str | os.PathLike[str] | None = None) -> str:
    """SHA-256 of the library's and the benchmarks' source files (paths and bytes).

    Names the code that ran whatever git says: the same digest computed on a
    checkout of a commit tells whether that commit is the one measured.
    """
    base = Path(__file__).resolve().parent.parent if root is None else Path(root)
    digest = hashlib.sha256()
    for top in SOURCE_DIRS:
        for path in sorted((base / top).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".yaml", ".cu", ".cuh", ".sh"}:
                digest.update(path.relative_to(base).as_posix().encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> dict[str, Any]:
    """Everything about the machine and software a reader needs to trust a number."""
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable_cores(),
        # The first CPU's caches: the NumPy engine's cache-dependent choices (row
        # blocks, the fused LAMM pass) were measured against these sizes.
        "cpu_caches": cpu_caches(0),
        "blas": blas_info(),
        "gpu": gpu_info(),
        "packages": package_versions(
            [
                "rh-dask",
                "numpy",
                "scipy",
                "scikit-learn",
                "dask",
                "distributed",
                "cupy",
                "cupy-cuda12x",
                "cupy-cuda13x",
                "dask-cuda",
                "renewable-huber",
                "dask-ml",
            ]
        ),
        "git_revision": git_revision(),
        "git_tree_clean": git_tree_clean(),
        "source_sha256": source_digest(),
    }


def fingerprint(*arrays: np.ndarray) -> str:
    """SHA-256 of the arrays' dtypes, shapes and bytes (identifies a dataset)."""
    h = hashlib.sha256()
    for arr in arrays:
        arr = np.ascontiguousarray(arr)
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def fit_chunks(engine: Any, chunks: Iterable[tuple[Any, ...]]) -> str:
    """Fit every chunk in order, as the engine streams best; returns the path taken.

    ``partial_fit_stream`` where the engine has it (the GPU engine overlaps
    each copy with the previous solve), else one ``partial_fit`` per chunk.
    """
    stream = getattr(engine, "partial_fit_stream", None)
    if stream is not None:
        for _ in stream(chunks):
            pass
        return "partial_fit_stream"
    for chunk in chunks:
        engine.partial_fit(*chunk)
    return "partial_fit"


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min, max and spread of repeated timings (seconds)."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "repeats": len(samples),
    }


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    # The digest of this checkout's sources, to match against a result's source_sha256.
    print(source_digest())
