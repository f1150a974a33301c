"""Fitting, predicting and scoring on Dask collections.

``RenewableHuberRegressor.partial_fit``/``fit`` route Dask arrays and
DataFrames to :func:`stream_fit`: the row chunks are walked strictly in
order into one engine, resident in a Dask actor on one worker, while later
chunks load in parallel on the cluster (see ``docs/distributed.md``).
Without a ``distributed`` client the same walk runs in this process.
``predict``/``score`` on Dask collections are lazy and need no actor.
Engines stay parked on their worker for a while after a clean stream, for the
next fit (:func:`release_engines` closes them at once).
"""

from .coordinator import ActorLostError
from .fit import stream_fit
from .predict import predict_dask, score_dask
from .shelf import release_engines

__all__ = ["ActorLostError", "predict_dask", "release_engines", "score_dask", "stream_fit"]
