"""Detached fits: the walk coordinated from a task inside the cluster, collected by name.

:func:`submit_fit` sends ``estimator.fit(X, y, sample_weight)`` to the
cluster as one long-running task. The task secedes from its worker's thread
pool (:func:`distributed.worker_client`) and runs the same walk a client
runs (the same actor, loader, look-ahead and checkpoints), with the worker's
own client in charge: :func:`~.fit.current_client` inside the task is that
client, so the engine actor and every load belong to the cluster, not to
the process that submitted the fit. The task's future is published on the
scheduler under the fit's name (:meth:`distributed.Client.publish_dataset`),
which keeps the task wanted when the submitting client disconnects; a later
client takes it back with :meth:`DetachedFit.attach`. The fitted estimator
is the task's result (it pickles its portable state, never an engine).

While it runs, the task publishes its progress in a
:class:`distributed.Variable` named ``f"{name}-progress"`` (at most every
:data:`PROGRESS_INTERVAL` seconds, and at the start and end of every
attempt), and looks for the cancellation :class:`distributed.Event`
``f"{name}-cancel"`` at the same pace: a cancelled walk stops as an
interrupted one does. When Dask runs the task again because its worker died,
the new attempt continues from the estimator's ``checkpoint_dir`` when it
holds a checkpoint of this input (``fit(..., resume_from=...)``, fingerprint
checked), else it starts over.

Only public ``distributed`` API is used: ``worker_client``, ``Client.submit``,
``publish_dataset``/``get_dataset``/``unpublish_dataset``, ``Variable``,
``Event`` and ``Client.cancel(..., force=True)`` (a published future is also
wanted by the scheduler's publication, which a plain cancel respects).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import dask
import pandas as pd

from ..exceptions import CheckpointError, DetachedFitError, ValidationError
from .fit import current_client
from .progress import watch_progress

logger = logging.getLogger(__name__)

#: Seconds between two progress updates a running fit publishes (about 4 per
#: second). Not a setting: each update is one scheduler call from the
#: coordinating task, and this pace is both cheap and fresh enough to watch.
PROGRESS_INTERVAL = 0.25

#: Tag of the record published under a fit's name, so that ``attach`` can
#: tell a detached fit from any other published dataset.
_TAG = "rh-dask-detached-fit"

#: How long the task waits for the progress record the submitter set before it
#: submitted (it is there already; the bound only covers a scheduler in trouble).
_RECORD_WAIT_SECONDS = 10.0

#: What ``distributed`` raises on a timeout (``asyncio.TimeoutError`` is not
#: the built-in ``TimeoutError`` before Python 3.11).
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)

STATUSES = ("running", "finished", "error", "cancelled", "lost")


def _progress_name(name: str) -> str:
    return f"{name}-progress"


def _cancel_name(name: str) -> str:
    return f"{name}-cancel"


def _record(
    chunks_done: int, n_chunks: int | None, rows_done: int, attempt: int
) -> dict[str, Any]:
    """The msgpack-able progress record a :class:`distributed.Variable` holds."""
    return {
        "chunks_done": int(chunks_done),
        "n_chunks": None if n_chunks is None else int(n_chunks),
        "rows_done": int(rows_done),
        "updated": time.time(),
        "attempt": int(attempt),
    }


def _require_client(client: Any | None) -> Any:
    found = current_client() if client is None else client
    if found is None:
        raise DetachedFitError(
            "a detached fit runs on a distributed cluster, but there is no client: "
            "create a distributed.Client (or pass client=...)"
        )
    return found


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ValidationError(f"name must be a non-empty string, got {name!r}")
    return name


# -- the task ----------------------------------------------------------------------------
class _Publisher:
    """The task's progress hook: publishes at most every PROGRESS_INTERVAL, checks for a cancel."""

    def __init__(self, variable: Any, cancel: Any, attempt: int, name: str) -> None:
        self.variable = variable
        self.cancel = cancel
        self.attempt = attempt
        self.name = name
        self.last = (0, None, 0)
        self._published = -float("inf")

    def publish(self) -> None:
        self.variable.set(_record(*self.last, self.attempt))
        self._published = time.monotonic()

    def __call__(self, chunks_done: int, n_chunks: int, rows_done: int) -> None:
        self.last = (chunks_done, n_chunks, rows_done)
        if time.monotonic() - self._published < PROGRESS_INTERVAL:
            return
        self.publish()
        if self.cancel.is_set():
            raise DetachedFitError(f"the detached fit {self.name!r} was cancelled")


def _attempt(variable: Any) -> int:
    """How many runs of this fit's task started before this one."""
    try:
        record = variable.get(timeout=_RECORD_WAIT_SECONDS)
    except _TIMEOUTS:
        return 0
    return int(record.get("attempt", 0)) if isinstance(record, dict) else 0


def _fit(estimator: Any, X: Any, y: Any, sample_weight: Any, attempt: int, name: str) -> None:
    """The fit itself; a repeated attempt resumes from the estimator's checkpoint_dir."""
    location = getattr(estimator, "checkpoint_dir", None)
    if attempt > 1 and location is not None:
        try:
            estimator.fit(X, y, sample_weight, resume_from=location)
            return
        except CheckpointError as exc:
            # The last attempt left nothing of this input there (it died before
            # its first checkpoint): start over, as that attempt did.
            logger.warning(
                "detached fit %r, attempt %d: no checkpoint to resume from (%s); "
                "fitting from the first chunk",
                name,
                attempt,
                exc,
            )
    estimator.fit(X, y, sample_weight)


def run_detached(estimator: Any, X: Any, y: Any, sample_weight: Any, name: str) -> Any:
    """The body of a detached fit's task: ``estimator.fit`` coordinated from this worker.

    Runs in a task on a worker, seceded from its thread pool for as long as
    the walk lasts. The progress bar is off while it runs (nobody watches a
    worker's stderr; :meth:`DetachedFit.progress` does) and the estimator's
    own ``progress`` parameter is restored before it is returned.

    Parameters
    ----------
    estimator : RenewableHuberRegressor
    X, y, sample_weight
        As for ``estimator.fit``.
    name : str
        The fit's published name (its progress and cancel records derive from it).

    Returns
    -------
    RenewableHuberRegressor
        ``estimator``, fitted.
    """
    from distributed import Event, Variable, worker_client

    with worker_client() as client:
        variable = Variable(_progress_name(name), client=client)
        attempt = _attempt(variable) + 1
        publisher = _Publisher(variable, Event(_cancel_name(name), client=client), attempt, name)
        publisher.publish()
        shown = estimator.progress
        estimator.progress = False
        try:
            with watch_progress(publisher):
                _fit(estimator, X, y, sample_weight, attempt, name)
        finally:
            estimator.progress = shown
            try:
                publisher.publish()
            except Exception as exc:  # a lost scheduler must not hide the fit's own error
                logger.warning(
                    "detached fit %r: the last progress was not published: %s", name, exc
                )
    return estimator


# -- the client side -----------------------------------------------------------------------
def submit_fit(
    estimator: Any,
    X: Any,
    y: Any,
    sample_weight: Any | None = None,
    *,
    name: str | None = None,
    client: Any | None = None,
) -> DetachedFit:
    """Fit ``estimator`` on Dask collections from inside the cluster; return a handle at once.

    The walk is the one ``estimator.fit(X, y, sample_weight)`` runs (same
    parameters, same result, bit for bit), coordinated by a task on a worker
    instead of this process, so it goes on when this client disconnects.
    ``estimator`` itself is not changed: the fitted copy is the handle's
    :meth:`~DetachedFit.result`.

    Parameters
    ----------
    estimator : RenewableHuberRegressor
        Its parameters (``checkpoint_dir`` included) are those of the fit.
    X : dask.array.Array or dask.dataframe.DataFrame
    y : Dask array or Series, or a column name of ``X``
    sample_weight : like ``y``, optional
    name : str, optional
        The name a later client attaches by (default ``"rh-dask-fit-<8 hex>"``).
    client : distributed.Client, optional
        Default: the current client.

    Returns
    -------
    DetachedFit

    Raises
    ------
    ValidationError
        ``X`` is not a Dask collection, ``name`` is not a non-empty string, or a
        fit is published under ``name`` already (nothing is submitted).
    DetachedFitError
        There is no client.
    """
    if not dask.is_dask_collection(X):
        raise ValidationError(
            "submit_fit walks a Dask array or DataFrame on the cluster, got "
            f"{type(X).__name__}; fit in-memory data with estimator.fit"
        )
    if not callable(getattr(estimator, "fit", None)) or not hasattr(estimator, "progress"):
        raise ValidationError(
            f"submit_fit needs a RenewableHuberRegressor, got {type(estimator).__name__}"
        )
    name = _check_name(f"rh-dask-fit-{uuid.uuid4().hex[:8]}" if name is None else name)
    client = _require_client(client)
    if name in client.list_datasets():
        raise ValidationError(
            f"a dataset named {name!r} is published on the scheduler already; choose "
            "another name, or forget() that fit first"
        )
    from distributed import Event, Variable, futures_of

    # The record is there before the task starts: the task counts its attempts from it.
    Variable(_progress_name(name), client=client).set(_record(0, None, 0, 0))
    Event(_cancel_name(name), client=client).clear()
    future = client.submit(
        run_detached,
        estimator,
        X,
        y,
        sample_weight,
        name,
        key=f"rh-dask-detached-{name}-{uuid.uuid4().hex[:8]}",
        pure=False,
    )
    # Persisted inputs are held by the client that persisted them: the
    # publication holds them too, so that they outlive it with the task.
    inputs = futures_of([a for a in (X, y, sample_weight) if dask.is_dask_collection(a)])
    record = {"tag": _TAG, "future": future, "inputs": inputs}
    try:
        client.publish_dataset(record, name=name)
    except KeyError:  # published by another client since the check above
        client.cancel([future], force=True)
        raise ValidationError(
            f"a dataset named {name!r} was published on the scheduler meanwhile; choose "
            "another name"
        ) from None
    return DetachedFit(name, future, client)


class DetachedFit:
    """A handle on a fit running inside the cluster (see :func:`submit_fit`).

    Obtain one from :func:`submit_fit` or, from any client of the same
    scheduler, with :meth:`attach`. Several handles of the same fit may exist
    at once; the fit lives until :meth:`forget`, whoever holds handles.

    Attributes
    ----------
    name : str
        The name the fit is published under.
    client : distributed.Client
        The client this handle talks through.
    """

    def __init__(self, name: str, future: Any | None, client: Any) -> None:
        self.name = name
        self.client = client
        # None once the fit was cancelled: its task is gone from the scheduler.
        self._future = future
        self._forgotten = False

    def __repr__(self) -> str:
        return f"<DetachedFit {self.name!r}: {self.status()}>"

    @classmethod
    def attach(cls, name: str, client: Any | None = None) -> DetachedFit:
        """The handle of the fit published under ``name``, from any client of its scheduler.

        Raises
        ------
        DetachedFitError
            No fit is published under ``name`` (never submitted, forgotten, or
            another scheduler), or there is no client.
        """
        name = _check_name(name)
        client = _require_client(client)
        record = client.get_dataset(name, default=None)
        if not isinstance(record, dict) or record.get("tag") != _TAG:
            published = [n for n in client.list_datasets() if isinstance(n, str)]
            what = "no fit" if record is None else "a dataset that is not a detached fit"
            raise DetachedFitError(
                f"{what} is published under {name!r} on the scheduler "
                f"{client.scheduler.address}; published names: {published}"
            )
        return cls(name, record["future"], client)

    def _cancelled(self) -> bool:
        from distributed import Event

        return bool(Event(_cancel_name(self.name), client=self.client).is_set())

    def status(self) -> str:
        """Where the fit stands: one of :data:`STATUSES`.

        ``"running"`` includes a task still queued; ``"cancelled"``: after
        :meth:`cancel`, from any handle; ``"lost"``: the scheduler lost the
        task's result (its worker died after the fit finished), and Dask runs
        the task again (with a ``checkpoint_dir``, that run only reloads the
        finished checkpoint).
        """
        if self._future is None:
            return "cancelled"
        state = self._future.status
        if state in ("finished", "error"):
            return state
        if state == "cancelled" or self._cancelled():
            return "cancelled"
        if state == "lost":
            return "lost"
        return "running"

    def progress(self) -> dict[str, Any]:
        """The last progress the fit published.

        Returns
        -------
        dict
            ``chunks_done``, ``n_chunks`` (``None`` until the walk started),
            ``rows_done``, ``updated`` (a UTC :class:`pandas.Timestamp`) and
            ``attempt`` (runs of the task so far: more than 1 when Dask ran it
            again after its worker died; 0 while it has not started).

        Raises
        ------
        DetachedFitError
            The fit was forgotten.
        """
        from distributed import Variable

        record = None
        if not self._forgotten:  # a deletion is sent without waiting for the scheduler
            try:
                record = Variable(_progress_name(self.name), client=self.client).get(timeout=0)
            except _TIMEOUTS:
                record = None
        if record is None:
            raise DetachedFitError(
                f"the detached fit {self.name!r} has no progress record: it was forgotten"
            )
        out = dict(record)
        out["updated"] = pd.Timestamp(record["updated"], unit="s", tz="UTC")
        return out

    def wait(self, timeout: float | None = None, progress: bool = False) -> str:
        """Block until the fit is done (finished, failed or cancelled); return :meth:`status`.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most (``None``: no limit).
        progress : bool, default False
            Draw a progress bar (chunks, rows/s) from the published progress.

        Raises
        ------
        TimeoutError
            The fit was still running after ``timeout`` seconds.
        """
        from distributed import wait as wait_futures

        if self._future is None:
            return "cancelled"
        if not progress:
            try:
                with self.client.as_current():  # distributed.wait asks for the default client
                    wait_futures([self._future], timeout=timeout)
            except asyncio.CancelledError:
                pass
            except _TIMEOUTS:
                raise TimeoutError(
                    f"the detached fit {self.name!r} was still running after {timeout} s"
                ) from None
            return self.status()
        return self._wait_drawing(timeout)

    def _wait_drawing(self, timeout: float | None) -> str:
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        with tqdm(unit="chunk", desc=f"rh-dask fit {self.name}", dynamic_ncols=True) as bar:
            while True:
                done = self._future.done()
                record = self.progress()
                if record["n_chunks"] is not None:
                    bar.total = record["n_chunks"]
                bar.n = record["chunks_done"]
                bar.set_postfix_str(f"{record['rows_done']:,} rows", refresh=False)
                bar.refresh()
                if done or self.status() == "cancelled":
                    return self.status()
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the detached fit {self.name!r} was still running after {timeout} s"
                    )
                time.sleep(PROGRESS_INTERVAL)

    def result(self, timeout: float | None = None) -> Any:
        """The fitted estimator; the fit's own error (raised as it was) when it failed.

        Raises
        ------
        DetachedFitError
            The fit was cancelled.
        TimeoutError
            It was still running after ``timeout`` seconds.
        """
        if self._future is None or self.status() == "cancelled":
            raise DetachedFitError(f"the detached fit {self.name!r} was cancelled")
        try:
            return self._future.result(timeout=timeout)
        except asyncio.CancelledError:  # distributed's FutureCancelledError is one
            raise DetachedFitError(f"the detached fit {self.name!r} was cancelled") from None
        except _TIMEOUTS:
            if self._future.done():  # the fit's own error
                raise
            raise TimeoutError(
                f"the detached fit {self.name!r} was still running after {timeout} s"
            ) from None

    def cancel(self) -> None:
        """Stop the fit: its walk stops within about ``PROGRESS_INTERVAL`` of its next chunk.

        The task is cancelled on the scheduler (whoever else wants it), and
        the running walk, which a thread cannot be made to leave, sees the
        cancel record at its next progress update and ends its engine's stream
        as an interrupted walk does. The name stays published (its status is
        ``"cancelled"``, from any handle) until :meth:`forget`; the publication
        no longer holds the task or the persisted inputs.
        """
        from distributed import Event

        Event(_cancel_name(self.name), client=self.client).set()
        if self._future is None:
            return
        self.client.cancel([self._future], force=True)
        self.client.publish_dataset(
            {"tag": _TAG, "future": None, "inputs": []},
            name=self.name,
            override=True,
        )
        self._future = None

    def forget(self) -> None:
        """Unpublish the fit: its name, progress and cancel records go, and its result.

        A running fit is not stopped by this (call :meth:`cancel` first), but
        no client can attach to it any more.
        """
        from distributed import Event, Variable

        self.client.unpublish_dataset(self.name)
        Variable(_progress_name(self.name), client=self.client).delete()
        self._forgotten = True
        Event(_cancel_name(self.name), client=self.client).clear()
