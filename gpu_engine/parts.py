"""What the per-batch drivers of one engine share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rh_dask.config import HuberConfig

from .driver import DriverCalls
from .kernels import Kernels
from .launch import Launcher
from .solver import DenseSolver
from .workspace import Workspace


@dataclass(frozen=True)
class DeviceParts:
    """One engine's device-side collaborators, built once by :class:`GpuEngine`.

    Attributes
    ----------
    config : HuberConfig
        The stream's configuration (``max_iter``, dtype).
    kernels : Kernels
        The compiled kernels (shared-memory limits).
    calls : DriverCalls
        Queues copies and launches, synchronises with the device.
    stream : cupy.cuda.Stream
        The engine's stream.
    dense : DenseSolver
        cuBLAS/cuSOLVER calls and the fallback ladder.
    ws : Workspace
        The engine's buffers.
    launcher : Launcher
        Prepared launches and graphs.
    """

    config: HuberConfig
    kernels: Kernels
    calls: DriverCalls
    stream: Any
    dense: DenseSolver
    ws: Workspace
    launcher: Launcher
