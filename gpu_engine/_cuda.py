"""Lazy access to CuPy and device resolution.

Nothing here imports CuPy at module import time, so ``import gpu_engine`` works
on machines without a GPU (CI collects the tests there); the engine's
constructor turns a missing CuPy, driver or device into
:class:`rh_dask.exceptions.EngineUnavailableError`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from rh_dask.exceptions import EngineUnavailableError


def import_cupy() -> ModuleType:
    """CuPy, or :class:`EngineUnavailableError` saying why it cannot be used."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA library underneath
        raise EngineUnavailableError(
            f"engine='gpu' needs CuPy (pip install rh-dask[gpu]); importing it failed: {exc}"
        ) from exc
    return cupy


def device_count(cp: ModuleType) -> int:
    """Number of visible CUDA devices (0 when the driver is missing)."""
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def resolve_device(cp: ModuleType, device: Any) -> int:
    """Map ``None``, ``"cuda"``, ``"cuda:N"`` or ``N`` to a device index that exists.

    Raises
    ------
    EngineUnavailableError
        When no GPU is visible, the spec is not a CUDA device, or the index
        does not exist.
    """
    count = device_count(cp)
    if count == 0:
        raise EngineUnavailableError(
            "engine='gpu' needs a CUDA GPU, but CuPy sees none (no driver or no device); "
            "use engine='numpy'"
        )
    if device is None:
        index = 0
    elif isinstance(device, bool):
        raise EngineUnavailableError(f"device must be 'cuda', 'cuda:N' or an int, got {device!r}")
    elif isinstance(device, int):
        index = device
    elif hasattr(device, "id") and isinstance(getattr(device, "id", None), int):
        index = int(device.id)  # a cupy.cuda.Device
    else:
        spec = str(device).strip().lower()
        if spec == "cuda":
            index = 0
        elif spec.startswith("cuda:") and spec[5:].isdigit():
            index = int(spec[5:])
        else:
            raise EngineUnavailableError(
                f"the GPU engine runs on a CUDA device ('cuda' or 'cuda:N'); got device={device!r}"
            )
    if not 0 <= index < count:
        raise EngineUnavailableError(
            f"device cuda:{index} does not exist: {count} CUDA device(s) visible "
            f"(cuda:0..cuda:{count - 1})"
        )
    return index
