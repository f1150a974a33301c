"""Fitting, predicting and scoring on Dask collections.

``RenewableHuberRegressor.partial_fit``/``fit`` route Dask arrays and
DataFrames to :func:`stream_fit` with the model's
:class:`~rh_dask.stream.Stream`: the row chunks are walked strictly in
order into one engine, resident in a Dask actor on one worker, while later
chunks load in parallel on the cluster (see ``docs/distributed.md``).
Without a ``distributed`` client the same walk runs in this process.
``predict``/``score`` on Dask collections are lazy and need no actor.
:func:`submit_fit` runs the same walk coordinated from a task inside the
cluster, so that it survives the client (:class:`DetachedFit` reconnects).
Engines stay parked on their worker for a while after a clean stream, for the
next fit (:func:`release_engines` closes them at once). This package never
imports the estimator. ``ActorLostError`` is :class:`rh_dask.ActorLostError`.
"""

from ..exceptions import ActorLostError
from .detached import DetachedFit, submit_fit
from .fit import WalkOptions, column_vector_target, stream_fit
from .predict import predict_dask, score_dask
from .shelf import release_engines

__all__ = [
    "ActorLostError",
    "DetachedFit",
    "WalkOptions",
    "column_vector_target",
    "predict_dask",
    "release_engines",
    "score_dask",
    "stream_fit",
    "submit_fit",
]
