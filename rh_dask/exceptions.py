"""Errors raised by rh-dask.

Every error a user can cause derives from :class:`RhDaskError`, so that a
caller can catch the library's errors without catching unrelated ones.
"""

from __future__ import annotations

from sklearn.exceptions import NotFittedError as _SklearnNotFittedError

__all__ = [
    "ActorLostError",
    "BadChunkError",
    "CertificateError",
    "CheckpointError",
    "ClusterError",
    "DetachedFitError",
    "EngineUnavailableError",
    "InferenceError",
    "InputError",
    "InputTypeError",
    "MissingExtraError",
    "NotFittedError",
    "RhDaskError",
    "RingError",
    "SchedulerLostError",
    "StreamError",
    "ValidationError",
]


class RhDaskError(Exception):
    """Base class of the errors rh-dask raises on purpose."""


class NotFittedError(RhDaskError, _SklearnNotFittedError):
    """A fitted attribute, ``predict`` or ``save`` was used before any batch.

    Also scikit-learn's :class:`sklearn.exceptions.NotFittedError` (and so a
    ``ValueError`` and an ``AttributeError``: ``hasattr(model, "coef_")`` is
    false on an unfitted model), so code written for scikit-learn catches it.
    """


class ValidationError(RhDaskError, ValueError):
    """A batch, a weight vector or a parameter failed validation.

    The model is left exactly as it was before the call that raised.
    """


class InputTypeError(ValidationError, TypeError):
    """Input of a type that cannot be converted to numbers (e.g. objects, sparse).

    Both a :class:`ValidationError` and a :class:`TypeError`, so that callers
    catching either (scikit-learn's convention is ``TypeError``) see it.
    """


class EngineUnavailableError(RhDaskError, RuntimeError):
    """An explicitly requested engine (or device) cannot be started here."""


class CheckpointError(RhDaskError, ValueError):
    """A checkpoint file is corrupted, foreign or of an unsupported version."""


class StreamError(RhDaskError, RuntimeError):
    """A distributed stream failed part-way (a bad chunk, a lost worker).

    Attributes
    ----------
    chunk_index : int or None
        Index of the chunk that failed, when the failure belongs to one.
    """

    def __init__(self, message: str, chunk_index: int | None = None) -> None:
        super().__init__(message)
        self.chunk_index = chunk_index


class SchedulerLostError(StreamError):
    """The Dask scheduler of a distributed stream went away mid-walk.

    Every future of the stream, the engine's actor among them, is gone with
    the scheduler's connection. The model keeps the state it had before the
    call; the message names the scheduler's address.

    Attributes
    ----------
    address : str or None
        The scheduler that was lost.
    """

    def __init__(
        self, message: str, chunk_index: int | None = None, address: str | None = None
    ) -> None:
        super().__init__(message, chunk_index)
        self.address = address


class ActorLostError(StreamError):
    """The worker holding a distributed stream's engine actor disappeared mid-walk.

    The engine's state went with it, and Dask never recreates a lost actor,
    so the stream cannot continue there. The model keeps the state it had
    before the call.
    """


class BadChunkError(StreamError, ValidationError):
    """A chunk of a Dask stream was refused for its data (bad values, width, types).

    Both a :class:`StreamError` (the stream stopped at ``chunk_index``; the
    model keeps the state after the last good chunk) and a
    :class:`ValidationError`, so bad data in a stream is caught as a
    ``ValueError`` just like bad data in memory. A chunk whose loading failed
    for another reason (an I/O error in its task) raises a plain
    :class:`StreamError`.
    """


class DetachedFitError(RhDaskError, LookupError):
    """A detached fit cannot be started, found or collected.

    Raised when no fit is published under the name given to
    :meth:`rh_dask.distributed.DetachedFit.attach` (or it was forgotten),
    when there is no ``distributed`` client to reach the cluster, and by
    ``result()`` of a fit that was cancelled. A fit that failed raises its own
    error instead. Also a :class:`LookupError`.
    """


class InputError(RhDaskError, ValueError):
    """An input cannot be read as asked.

    No such file, a glob that matches nothing, an unknown column or format, or
    a bad file of a dataset: a Parquet file whose footer is corrupt, whose
    schema differs from the first file's, or that lacks a requested column.
    Raised by the readers (:mod:`rh_dask.readers`) before any chunk is
    fitted, so a model is left as it was. Also a :class:`ValueError`.

    Attributes
    ----------
    path : str or None
        The file (or store) the error is about, when it is about one.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class InferenceError(RhDaskError, ValueError):
    """A fitted model's covariance (``cov_``, ``bse_``, ``conf_int``, ``summary``) is unavailable.

    Raised for ``penalty="l1"`` (the sandwich is no valid interval for
    coefficients the lasso selected), for a state without the accumulated
    score variance K (restored from a checkpoint older than format version 2,
    or fitted by the GPU engine, which does not accumulate it), and for a
    singular information matrix J. The message says which. The model is not
    changed. Also a :class:`ValueError`.
    """


class MissingExtraError(RhDaskError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class ClusterError(RhDaskError, RuntimeError):
    """The scheduler cannot be reached, or the cluster has no usable workers."""


class CertificateError(ClusterError):
    """TLS credentials are missing, unreadable, expired or from another CA.

    Also raised when a TLS scheduler refuses the client's certificate, or
    presents one the client's CA did not sign. A :class:`ClusterError`, so
    the command line exits with code 4.
    """


class RingError(RhDaskError, OSError):
    """The shared-memory chunk ring of ``loader="relay"`` cannot be made, attached or written.

    An :class:`OSError` too: the causes are the filesystem's (no space in
    ``rh-dask.relay.directory``, a directory that does not exist, a worker of
    another node that cannot see the ring's file).
    """
