"""Placeholder until the GPU engine lands (issue 3): no GPU engine exists yet."""

from __future__ import annotations

from typing import Any

from rh_dask.exceptions import EngineUnavailableError


class GpuEngine:
    name = "gpu"
    accepts_device_arrays = True

    def __init__(self, config: Any, device: Any = None) -> None:
        raise EngineUnavailableError("the GPU engine is not part of this build yet")
