"""Compilation and caching of the engine's CUDA kernels.

The kernels live in ``gpu_engine/kernels/huber.cu`` as templates over the
compute dtype; they are compiled once per (device, dtype) per process by NVRTC
through :class:`cupy.RawModule` (CuPy also caches the binary on disk), with
the control-block layout of :mod:`gpu_engine.layout` prepended as defines and
the numerical contract's constants of :mod:`rh_dask.core` defined in the
compile options. No fast-math option is passed: float32 and float64
arithmetic stay IEEE.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.core import LAMM_MAX_TRIALS, LAMM_MIN_PHI, LAMM_SLACK

from . import layout

SOURCE = Path(__file__).with_name("kernels") / "huber.cu"

#: NVRTC options: C++17, and the contract's constants as defines; ``repr`` writes
#: the shortest literal that parses back to the same double, so the kernels
#: compare against exactly the reference's values.
COMPILE_OPTIONS: tuple[str, ...] = (
    "--std=c++17",
    f"-DRH_LAMM_SLACK={float(LAMM_SLACK)!r}",
    f"-DRH_LAMM_MIN_PHI={float(LAMM_MIN_PHI)!r}",
    f"-DRH_LAMM_MAX_TRIALS={int(LAMM_MAX_TRIALS)}",
)

KERNEL_NAMES: tuple[str, ...] = (
    "rh_build",
    "rh_newton_eval",
    "rh_newton_assemble",
    "rh_newton_solve",
    "rh_newton_solve_blocked",
    "rh_newton_solve_columns_s",
    "rh_newton_solve_columns_m",
    "rh_newton_solve_columns_l",
    "rh_newton_solve_tiles",
    "rh_newton_search",
    "rh_commit_eval",
    "rh_commit_finish",
    "rh_lamm_eval",
    "rh_lamm_trials",
    "rh_predict",
    "rh_wide_symv",
    "rh_wide_assemble",
    "rh_wide_commit_gram",
    "rh_wide_lamm_symv",
    "rh_lamm_trials_wide",
    "rh_score_gram_rows",
)

_LOCK = threading.Lock()
_CACHE: dict[tuple[int, str], Kernels] = {}


class Kernels:
    """The compiled kernels of one (device, dtype), as ``cupy.RawKernel`` attributes."""

    def __init__(self, cp: ModuleType, device_id: int, dtype: np.dtype) -> None:
        ctype = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}[np.dtype(dtype)]
        #: Each kernel's dynamic shared-memory limit as last read or set.
        self._dynamic_limits: dict[str, int] = {}
        code = layout.cuda_defines() + SOURCE.read_text()
        expressions = [f"{name}<{ctype}>" for name in KERNEL_NAMES]
        with cp.cuda.Device(device_id):
            self.module = cp.RawModule(
                code=code, options=COMPILE_OPTIONS, name_expressions=expressions
            )
            self.functions: dict[str, Any] = {
                name: self.module.get_function(expr)
                for name, expr in zip(KERNEL_NAMES, expressions, strict=True)
            }
            for function in self.functions.values():
                _ = function.kernel  # load now: never inside a graph capture
            attr = cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
            self.max_shared = int(cp.cuda.runtime.deviceGetAttribute(attr, device_id))
            attr = cp.cuda.runtime.cudaDevAttrMultiProcessorCount
            self.multiprocessors = int(cp.cuda.runtime.deviceGetAttribute(attr, device_id))

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["functions"][name]
        except KeyError:
            raise AttributeError(name) from None

    def allow_shared(self, name: str, nbytes: int) -> None:
        """Raise a kernel's dynamic shared-memory limit to ``nbytes`` where it is lower.

        A kernel's default limit is 48 KiB *less its static shared memory*
        (``rh_wide_lamm_symv``'s 32 KiB of strip sums leave 16 KiB), so the
        limit is read from the kernel, not assumed to be 48 KiB: a launch
        between the two would fail. Call it outside graph captures; the
        limit is cached, so repeated calls make no CUDA call.
        """
        # Limits only rise: one already high enough needs no lock (this runs
        # for every batch of every engine).
        known = self._dynamic_limits.get(name)
        if known is not None and known >= nbytes:
            return
        # Under the module lock: engines may prepare their launches on threads
        # of their own, and a limit must never be lowered under another.
        with _LOCK:
            limits = self._dynamic_limits
            limit = limits.get(name)
            if limit is None:
                limit = int(self.functions[name].max_dynamic_shared_size_bytes)
            if limit < nbytes:
                self.functions[name].max_dynamic_shared_size_bytes = int(nbytes)
                limit = int(nbytes)
            limits[name] = limit


def get_kernels(cp: ModuleType, device_id: int, dtype: np.dtype) -> Kernels:
    """The process-wide compiled kernels of ``(device_id, dtype)``."""
    key = (device_id, np.dtype(dtype).name)
    with _LOCK:
        kernels = _CACHE.get(key)
        if kernels is None:
            kernels = Kernels(cp, device_id, dtype)
            _CACHE[key] = kernels
        return kernels
