"""Device-resident CUDA engine for rh-dask (CuPy + RawKernels + cuSOLVER).

Importing this package needs CuPy; ``rh_dask.make_engine("gpu", ...)`` turns a
missing CuPy or GPU into :class:`rh_dask.EngineUnavailableError`.
"""

from .engine import GpuEngine

__all__ = ["GpuEngine"]
