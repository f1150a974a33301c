"""rh-dask: renewable Huber regression on streams too large for one machine.

The public API:

* :class:`RenewableHuberRegressor`, a scikit-learn estimator that fits
  in-memory batches and Dask collections (row chunks are the batches);
* :class:`RenewableHuberGridRegressor`, many τ (and λ scale) values fitted
  from one pass over the stream and selected by prequential robust scores;
* :class:`HuberConfig`, :class:`HuberState`, :class:`BatchDiagnostics`, the
  portable configuration, state and per-batch diagnostics;
* :func:`make_engine` and the :class:`Engine` protocol, for callers that drive
  an engine directly (benchmarks, actors);
* the exceptions in :mod:`rh_dask.exceptions` and
  :class:`~rh_dask.settings.SettingError`: every error a user can cause;
* :func:`read_parquet`, :func:`read_zarr` and :func:`read_npy`
  (:mod:`rh_dask.readers`), the readers of Parquet datasets, Zarr stores and
  ``.npy`` files;
* :func:`huber_loss`, :func:`huber_scorer` and :data:`neg_huber_loss`
  (:mod:`rh_dask.metrics`), the robust criterion for choosing τ by validation.
"""

from . import settings  # noqa: F401  (merges rh-dask.yaml into dask.config)
from ._version import __version__
from .config import HuberConfig
from .engines import Engine, NumpyEngine, make_engine
from .estimator import RenewableHuberRegressor
from .exceptions import (
    ActorLostError,
    BadChunkError,
    CertificateError,
    CheckpointError,
    ClusterError,
    DetachedFitError,
    EngineUnavailableError,
    InferenceError,
    InputError,
    InputTypeError,
    MissingExtraError,
    NotFittedError,
    RhDaskError,
    RingError,
    SchedulerLostError,
    StreamError,
    ValidationError,
)
from .grid_estimator import RenewableHuberGridRegressor
from .metrics import huber_loss, huber_scorer, neg_huber_loss
from .readers import read_npy, read_parquet, read_zarr
from .settings import SettingError
from .state import BatchDiagnostics, HuberState

__all__ = [
    "ActorLostError",
    "BadChunkError",
    "BatchDiagnostics",
    "CertificateError",
    "CheckpointError",
    "ClusterError",
    "DetachedFitError",
    "Engine",
    "EngineUnavailableError",
    "HuberConfig",
    "HuberState",
    "InferenceError",
    "InputError",
    "InputTypeError",
    "MissingExtraError",
    "NotFittedError",
    "NumpyEngine",
    "RenewableHuberGridRegressor",
    "RenewableHuberRegressor",
    "RhDaskError",
    "RingError",
    "SchedulerLostError",
    "SettingError",
    "StreamError",
    "ValidationError",
    "__version__",
    "huber_loss",
    "huber_scorer",
    "make_engine",
    "neg_huber_loss",
    "read_npy",
    "read_parquet",
    "read_zarr",
]
