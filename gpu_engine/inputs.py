"""A batch's way in: structural checks, device views or pinned staging, validation flags.

Structure (dimensions, shapes, dtype, where the arrays live) is checked on
the host before anything is queued. Values (non-finite ``X``/``y``, negative
or non-finite weights) are checked on the device by ``rh_build``, which sets
bits of the control block's ``I_INVALID`` word; :func:`raise_if_invalid`
turns them into the error after the host's first synchronisation.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.exceptions import ValidationError
from rh_dask.validation import check_width

from . import layout
from .driver import DriverCalls
from .transfer import HostStager, StagedBatch, as_device_array

#: ``I_INVALID`` bits set by ``rh_build`` and the errors they stand for.
_INVALID_BITS = (
    (1, "X and y must be finite (found NaN or infinity)"),
    (2, "sample_weight must be finite and non-negative"),
)

_MIXED = "X, y and sample_weight must all be on the host or all on the device"


def is_cuda(obj: Any) -> bool:
    """Whether ``obj`` is a CUDA array (CuPy, ``__cuda_array_interface__``, DLPack)."""
    from rh_dask.validation import is_device_array

    return obj is not None and is_device_array(obj)


def raise_if_invalid(status_i: np.ndarray) -> None:
    """Raise the :class:`ValidationError` of the batch's device-side value checks, if any.

    Parameters
    ----------
    status_i : numpy.ndarray
        The int32 part of the host-mapped status block, read after a
        synchronisation.
    """
    flags = int(status_i[layout.I_INVALID])
    for bit, message in _INVALID_BITS:
        if flags & bit:
            raise ValidationError(message)


def check_shapes(X: Any, y: Any, w: Any | None, n_features: int | None) -> None:
    """Refuse a batch whose shapes disagree with each other or with the stream."""
    check_width(X, n_features)
    n = int(X.shape[0])
    if n < 1:
        raise ValidationError("a batch needs at least one row")
    if X.shape[1] < 1:
        raise ValidationError("a batch needs at least one feature")
    if tuple(y.shape) != (n,) or (w is not None and tuple(w.shape) != (n,)):
        raise ValidationError(f"y and sample_weight must have shape ({n},)")


def check_host_batch(
    X: Any, y: Any, w: Any | None, dtype: np.dtype, n_features: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Structural checks of a host batch for an engine of ``dtype``; values are checked later.

    Raises
    ------
    ValidationError
        For arrays on the device beside host ones, arrays that are not
        NumPy's, another dtype, or shapes that disagree.
    """
    arrays = (X, y) if w is None else (X, y, w)
    if any(is_cuda(a) for a in arrays):
        raise ValidationError(_MIXED)
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise ValidationError(
            "the GPU engine takes NumPy or CUDA arrays (validate the batch first)"
        )
    for name, arr in (("X", X), ("y", y), ("sample_weight", w)):
        if arr is not None and arr.dtype != dtype:
            raise ValidationError(f"{name} has dtype {arr.dtype}, the engine computes in {dtype}")
    check_shapes(X, y, w, n_features)
    return X, y, w


def accept_device_batch(
    cp: ModuleType,
    X: Any,
    y: Any,
    w: Any | None,
    device_id: int,
    dtype: np.dtype,
    stream: Any,
    caller_ready: Any,
    n_features: int | None,
) -> tuple[Any, Any, Any | None]:
    """Zero-copy views of a device batch, ``stream`` ordered after the caller's current one.

    ``caller_ready`` is an event of the caller's (recorded here). The views
    are made with ``stream`` current, so that DLPack producers order their
    pending work before it.

    Raises
    ------
    ValidationError
        For host arrays beside device ones, or arrays of another device,
        dtype, layout or shape (:func:`~.transfer.as_device_array`).
    """
    if not (is_cuda(y) and (w is None or is_cuda(w))):
        raise ValidationError(_MIXED)
    caller_ready.record(cp.cuda.get_current_stream())
    with stream:
        Xd = as_device_array(cp, X, "X", device_id, dtype, 2)
        yd = as_device_array(cp, y, "y", device_id, dtype, 1)
        wd = None if w is None else as_device_array(cp, w, "sample_weight", device_id, dtype, 1)
    check_shapes(Xd, yd, wd, n_features)
    stream.wait_event(caller_ready)
    return Xd, yd, wd


class BatchInputs:
    """Turns a caller's batch into device arrays the engine's stream may read.

    Device input is viewed without a copy and ordered after the caller's
    current stream; host input is staged through :class:`HostStager` (or
    taken from a matching :meth:`prefetch`).

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device.
    dtype : numpy.dtype
        The engine's compute dtype; inputs must already have it.
    stream : cupy.cuda.Stream
        The engine's stream.
    stager : HostStager
        Stages host batches.
    calls : DriverCalls, optional
        Queues stream waits (the engine passes its own).
    """

    def __init__(
        self,
        cp: ModuleType,
        device_id: int,
        dtype: np.dtype,
        stream: Any,
        stager: HostStager,
        calls: DriverCalls | None = None,
    ) -> None:
        self._cp = cp
        self._device_id = device_id
        self._dtype = dtype
        self._stream = stream
        self.stager = stager
        self._calls = calls if calls is not None else DriverCalls(cp)
        self._caller_ready = cp.cuda.Event(disable_timing=True)

    def prefetch(self, X: Any, y: Any, w: Any | None, n_features: int | None) -> None:
        """Start staging a host batch in the background (device input: nothing to do)."""
        if is_cuda(X):
            return
        X, y, w = self._check_host(X, y, w, n_features)
        self.stager.prefetch(X, y, w)

    def device_views(
        self, X: Any, y: Any, w: Any | None, n_features: int | None
    ) -> tuple[Any, Any, Any | None, StagedBatch | None]:
        """Device views of a batch: zero-copy for device input, staged for host input.

        The fourth item is the staging of a host batch (``None`` for device
        input): the engine's stream must wait for its ``slot.ready`` event.
        """
        if is_cuda(X):
            return (*self._accept_device(X, y, w, n_features), None)
        Xh, yh, wh = self._check_host(X, y, w, n_features)
        staged = self.stager.take(Xh, yh, wh) or self.stager.stage(Xh, yh, wh)
        return staged.X, staged.y, staged.w, staged

    def checked_views(
        self, X: Any, y: Any, w: Any | None, n_features: int | None, ready: Any
    ) -> tuple[Any, Any, Any | None, None]:
        """Device arrays whose device, dtype, layout and shapes were checked already.

        What a grid's shared copy of a batch is (:class:`gpu_engine.grid.DeviceGrid`
        checks it once for every engine): only the width against this
        stream is checked here, and the engine's stream waits for ``ready``
        (a CUDA event recorded after the work that made the arrays).
        """
        check_width(X, n_features)
        self._calls.stream_wait(self._stream.ptr, ready.ptr)
        return X, y, w, None

    def _check_host(
        self, X: Any, y: Any, w: Any | None, n_features: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Structural checks of a host batch; values are checked on the device."""
        return check_host_batch(X, y, w, self._dtype, n_features)

    def _accept_device(
        self, X: Any, y: Any, w: Any | None, n_features: int | None
    ) -> tuple[Any, Any, Any | None]:
        """Zero-copy views of device inputs, ordered after the caller's stream."""
        return accept_device_batch(
            self._cp,
            X,
            y,
            w,
            self._device_id,
            self._dtype,
            self._stream,
            self._caller_ready,
            n_features,
        )
