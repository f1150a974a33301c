"""Which devices this test run can use (a helper module for tests that branch on it)."""

from __future__ import annotations


def gpu_usable() -> bool:
    """Whether CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
