"""Z β with the engine's coefficients: on the host for NumPy input, on the device for CUDA."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.core import linear_predictor
from rh_dask.validation import check_width

from . import layout
from .inputs import is_cuda
from .kernels import Kernels
from .launch import Launcher
from .state import DeviceState
from .transfer import as_device_array
from .workspace import Workspace


class Predictor:
    """Predictions of one engine's stream.

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device.
    dtype : numpy.dtype
        The engine's compute dtype (device input must have it).
    stream : cupy.cuda.Stream
        The engine's stream.
    kernels : Kernels
        The compiled kernels (``rh_predict``).
    ws : Workspace
        Holds β on the device.
    launcher : Launcher
        Sizes the grid.
    state : DeviceState
        The stream's counters and host copy of β.
    """

    def __init__(
        self,
        cp: ModuleType,
        device_id: int,
        dtype: np.dtype,
        stream: Any,
        kernels: Kernels,
        ws: Workspace,
        launcher: Launcher,
        state: DeviceState,
    ) -> None:
        self._cp = cp
        self._device_id = device_id
        self._dtype = dtype
        self._stream = stream
        self._kernels = kernels
        self._ws = ws
        self._launcher = launcher
        self._state = state
        self._caller_ready = cp.cuda.Event(disable_timing=True)
        self._done_event = cp.cuda.Event(disable_timing=True)

    def predict(self, X: Any, closed: bool) -> Any:
        """Z β: NumPy out for host input, CuPy (on the engine's device) for device input.

        The device result is ordered before the caller's current stream.
        """
        counters = self._state.require()
        d = counters.n_features_in
        if not is_cuda(X):
            X = np.asarray(X)
            check_width(X, d)
            return linear_predictor(X, self._state.beta_on_host(closed), counters.fit_intercept)
        cp = self._cp
        with cp.cuda.Device(self._device_id):
            self._caller_ready.record(cp.cuda.get_current_stream())
            with self._stream:
                Xd = as_device_array(cp, X, "X", self._device_id, self._dtype, 2)
                check_width(Xd, d)
                self._stream.wait_event(self._caller_ready)
                n = int(Xd.shape[0])
                out = cp.empty(n, dtype=self._dtype)
                if n:
                    p = d + int(counters.fit_intercept)
                    self._kernels.rh_predict(
                        (self._launcher.grid(n),),
                        (layout.ROW_THREADS,),
                        (Xd, d, n, d, self._ws.beta, int(counters.fit_intercept), out),
                        shared_mem=p * self._ws.item,
                    )
                self._done_event.record(self._stream)
            cp.cuda.get_current_stream().wait_event(self._done_event)
        return out
