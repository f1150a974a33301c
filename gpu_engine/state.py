"""The stream's state on the GPU engine, and its import and export as a portable state.

β, J and K live in the workspace on the device for the whole stream; the
counters (rows and batches seen, λ of the last batch, Σw) live on the host.
:class:`DeviceState` holds the counters, answers β from the host-mapped
mirror the commit kernel writes, and converts to and from
:class:`rh_dask.state.HuberState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from rh_dask.exceptions import NotFittedError
from rh_dask.state import HuberState

from .workspace import Workspace


@dataclass(frozen=True)
class Counters:
    """The host side of the state: everything but β, J and K (a batch makes new ones)."""

    n_features_in: int
    fit_intercept: bool
    n_samples_seen: int = 0
    batch_count: int = 0
    previous_lambda: float = 0.0
    weight_sum: float = 0.0


@dataclass(frozen=True)
class HeldState:
    """What :meth:`DeviceState.hold` kept: the counters, and which device copy holds β, J, K."""

    counters: Counters | None
    k_valid: bool
    serial: int


class DeviceState:
    """The counters of a stream whose β and J are in ``ws``.

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device.
    stream : cupy.cuda.Stream
        The engine's stream (copies in and out are ordered on it).
    ws : Workspace
        Holds β and J.
    calls : DriverCalls, optional
        Queues the device copies of :meth:`hold` and :meth:`put_back`
        (default: CuPy's).
    """

    def __init__(
        self, cp: ModuleType, device_id: int, stream: Any, ws: Workspace, calls: Any = None
    ) -> None:
        self._cp = cp
        self._calls = calls
        self._device_id = device_id
        self._stream = stream
        self._ws = ws
        #: ``None`` before the first batch (and after :meth:`forget`).
        self.counters: Counters | None = None
        self._host_beta: np.ndarray | None = None
        #: Whether K in ``ws`` holds the stream's score variance (False after
        #: importing a state without one: K stays absent until a fresh stream).
        self._k_valid = True
        #: A device copy of β, J and K (``ws.state_block``) made by the latest :meth:`hold`.
        self._held: Any = None
        self._hold_serial = 0

    def require(self) -> Counters:
        """The counters, or :class:`NotFittedError` when the stream is empty."""
        if self.counters is None:
            raise NotFittedError("the engine has consumed no batch yet")
        return self.counters

    def forget(self) -> None:
        """Back to the empty state (the device buffers are zeroed by the next batch)."""
        self.counters = None
        self._host_beta = None
        self._k_valid = True

    def accumulates_k(self, enabled: bool) -> bool:
        """Whether the next batch adds to K: ``enabled`` and K is the stream's so far."""
        return enabled and (self.counters is None or self._k_valid)

    def advance(self, counters: Counters, accumulated_k: bool | None = None) -> None:
        """Record a committed batch: its counters; β is re-read from the mirror.

        ``accumulated_k``: whether the batch added to K (``None``: unchanged).
        """
        self.counters = counters
        self._host_beta = None
        if accumulated_k is not None:
            self._k_valid = accumulated_k

    def beta_on_host(self, closed: bool) -> np.ndarray:
        """β as the host sees it (read-only for callers: :meth:`coefficients` copies it)."""
        self.require()
        if self._host_beta is None:
            if closed:  # the mirror's pinned memory is freed
                raise RuntimeError("the GPU engine is closed")
            # The commit kernel mirrors β into host-mapped memory and the host
            # has synchronised since: reading it needs no CUDA call (the
            # distributed walk reads β after every batch).
            self._host_beta = self._ws.beta_host.copy()
        return self._host_beta

    def hold(self) -> HeldState:
        """Copy β, J and K on the device (queued on the current stream) for :meth:`put_back`.

        Only the latest hold is kept: the next one overwrites its copies.
        """
        self._hold_serial += 1
        counters = self.counters
        if counters is None:
            return HeldState(None, True, self._hold_serial)
        block = self._ws.state_block
        if self._held is None or self._held.shape != block.shape:
            self._held = self._cp.empty_like(block)
        self._copy(self._held, block)
        # Counters are replaced, never changed, by every batch: keeping the object is a copy.
        return HeldState(counters, self._k_valid, self._hold_serial)

    def _copy(self, dst: Any, src: Any) -> None:
        """Queue a device copy of ``src`` into ``dst`` on the current stream."""
        if self._calls is None:
            dst.data.copy_from_device_async(src.data, src.nbytes)
        else:
            stream = self._cp.cuda.get_current_stream().ptr
            self._calls.copy_on_device(dst.data.ptr, src.data.ptr, src.nbytes, stream)

    def put_back(self, held: HeldState) -> None:
        """Return to the state of the latest :meth:`hold`, after whatever was queued since.

        Raises
        ------
        ValueError
            When ``held`` is not the latest hold (its copies are overwritten).
        """
        if held.serial != self._hold_serial:
            raise ValueError("only the latest hold of the GPU engine's state can be put back")
        cp, ws, stream = self._cp, self._ws, self._stream
        with cp.cuda.Device(self._device_id), stream:
            stream.synchronize()
            if held.counters is None:
                self.forget()
                return
            assert self._held is not None
            self._copy(ws.state_block, self._held)
            ws.beta_host[...] = cp.asnumpy(ws.beta, stream=stream)
            stream.synchronize()
        self.counters = held.counters
        self._host_beta = None
        self._k_valid = held.k_valid

    def export(self) -> HuberState:
        """A host (NumPy) copy of the portable state."""
        counters = self.require()
        cp, ws = self._cp, self._ws
        with cp.cuda.Device(self._device_id):
            self._stream.synchronize()
            beta = cp.asnumpy(ws.beta, stream=self._stream)
            info = cp.asnumpy(ws.J, stream=self._stream)
            meat = cp.asnumpy(ws.K, stream=self._stream) if self._k_valid else None
            self._stream.synchronize()
        return HuberState(
            coefficients=beta,
            information=info,
            n_samples_seen=counters.n_samples_seen,
            batch_count=counters.batch_count,
            previous_lambda=counters.previous_lambda,
            weight_sum=counters.weight_sum,
            n_features_in=counters.n_features_in,
            fit_intercept=counters.fit_intercept,
            score_variance=meat,
        )

    def load(self, state: HuberState, fit_intercept: bool, dtype: np.dtype) -> None:
        """Replace the state by ``state`` (converted to ``dtype``); refused states change nothing.

        Raises
        ------
        ValidationError
            When ``state.fit_intercept`` is not the engine's, or the state
            is malformed.
        """
        state = state.for_engine(fit_intercept, dtype)
        cp, ws, stream = self._cp, self._ws, self._stream
        with cp.cuda.Device(self._device_id), stream:
            ws.ensure_params(state.n_params)
            ws.beta.set(np.ascontiguousarray(state.coefficients), stream=stream)
            ws.beta_host[...] = state.coefficients
            ws.J.set(np.ascontiguousarray(state.information), stream=stream)
            if state.score_variance is not None:
                ws.K.set(np.ascontiguousarray(state.score_variance), stream=stream)
            stream.synchronize()
        self.advance(
            Counters(
                n_features_in=int(state.n_features_in),
                fit_intercept=bool(state.fit_intercept),
                n_samples_seen=int(state.n_samples_seen),
                batch_count=int(state.batch_count),
                previous_lambda=float(state.previous_lambda),
                weight_sum=float(state.weight_sum),
            ),
            accumulated_k=state.score_variance is not None,
        )
