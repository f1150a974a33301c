"""The one engine interface: the estimator, the Dask actor and the benchmarks use it.

An engine owns the state of one stream and advances it one validated batch at
a time. It never sees Dask. Its inputs are already validated by
:func:`rh_dask.validation.validate_batch` (finite, right dtype, right width);
an engine re-checks only what is cheap and structural, and raises
:class:`~rh_dask.exceptions.ValidationError` *before* touching its state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from ..config import HuberConfig
from ..state import BatchDiagnostics, HuberState


@runtime_checkable
class Engine(Protocol):
    """Protocol every rh-dask engine implements.

    Attributes
    ----------
    name : str
        Registry name (``"numpy"``, ``"gpu"``).
    accepts_device_arrays : bool
        Whether ``partial_fit``/``predict`` take CUDA arrays (CuPy, DLPack).
    config : HuberConfig
        The configuration the engine was built with; fixed for its lifetime.

    Notes
    -----
    Optional capabilities, looked up with ``getattr`` by the callers that can
    use them (the GPU engine has both):

    ``partial_fit_stream(batches)``
        Fit an iterable of batches in order, yielding each batch's
        diagnostics; used by the distributed walk to overlap transfers.
    ``pinned_pool``
        An object whose ``copy_batch(X, y, w, wait=...)`` puts a host batch
        in memory the engine copies fastest from (returns ``None`` when it
        cannot without waiting); used by the distributed walk's loading
        threads.
    """

    name: ClassVar[str]
    accepts_device_arrays: ClassVar[bool]
    config: HuberConfig

    @property
    def device(self) -> str:
        """Where the state lives, e.g. ``"cpu"`` or ``"cuda:0"``."""
        ...

    @property
    def n_features_in(self) -> int | None:
        """Feature count of the stream, ``None`` before the first batch."""
        ...

    @property
    def batch_count(self) -> int:
        """Batches consumed since the last reset (0 when empty)."""
        ...

    @property
    def n_samples_seen(self) -> int:
        """Rows consumed since the last reset."""
        ...

    def partial_fit(self, X: Any, y: Any, sample_weight: Any | None = None) -> BatchDiagnostics:
        """Advance the stream by exactly one batch; atomic on failure."""
        ...

    def predict(self, X: Any) -> Any:
        """Z β for a validated X (host in → NumPy out, device in → device out)."""
        ...

    def coefficients(self) -> np.ndarray:
        """A host copy of β (intercept last)."""
        ...

    def export_state(self) -> HuberState:
        """A host (NumPy) copy of the portable state; raises if empty."""
        ...

    def import_state(self, state: HuberState) -> None:
        """Replace the state by a portable one (a checkpoint, another engine)."""
        ...

    def reset(self) -> None:
        """Forget the stream; keep workspaces for reuse."""
        ...
