"""rh-dask's settings in :mod:`dask.config`, under the ``rh-dask`` namespace.

The defaults ship with the package (``rh-dask.yaml`` beside this module)
and are merged into dask's configuration when :mod:`rh_dask` is imported,
the way ``distributed`` adds its own; a user's dask YAML files,
``dask.config.set`` and ``DASK_RH_DASK__...`` environment variables
override them.

:class:`Settings` holds every one of them, read and checked at once by
:meth:`Settings.from_config`. A distributed fit builds it once, on the
client, and hands it to the engine's actor as an argument: a value set on
the client is the value used on the worker, whatever that worker's own
configuration says.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from .exceptions import ValidationError

__all__ = [
    "IN_PROCESS_MAX_ROWS",
    "NUMPY_BLAS_THREADS",
    "ZARR_DIRECT",
    "SettingError",
    "Settings",
    "defaults",
    "env_name",
    "in_process_max_rows",
    "numpy_blas_threads",
    "setting_keys",
    "zarr_direct",
]

#: Rows below which ``--scheduler auto`` runs a command in this process.
IN_PROCESS_MAX_ROWS = "rh-dask.cli.in-process-max-rows"

#: BLAS threads of the NumPy engine's calls ("auto" or a count).
NUMPY_BLAS_THREADS = "rh-dask.numpy.blas-threads"

#: Whether rh_dask.read_zarr decodes whole chunks straight into batches.
ZARR_DIRECT = "rh-dask.readers.zarr-direct"

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "rh-dask.yaml")


class SettingError(ValidationError):
    """A setting of the ``rh-dask`` namespace holds a value it cannot take.

    A :class:`~rh_dask.exceptions.ValidationError` (and so a ``ValueError``);
    the message names the setting and its environment variable.
    """


def defaults() -> dict[str, Any]:
    """The packaged defaults (``rh-dask.yaml``) as a nested dict."""
    with open(_DEFAULTS_FILE, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def env_name(key: str) -> str:
    """The environment variable dask reads ``key`` from (``DASK_RH_DASK__...``)."""
    return "DASK_" + "__".join(part.replace("-", "_").upper() for part in key.split("."))


def _refuse(key: str, expected: str, value: Any) -> SettingError:
    return SettingError(f"setting {key} ({env_name(key)}) must be {expected}, got {value!r}")


def _whole(key: str, value: Any) -> int:
    """A whole number >= 0; text as YAML or an environment variable leaves it."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        value = int(text) if text.isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refuse(key, "a whole number >= 0", value)
    return value


def _count(key: str, value: Any) -> int:
    """A whole number >= 1."""
    try:
        count = _whole(key, value)
    except SettingError:
        count = 0
    if count < 1:
        raise _refuse(key, "a whole number >= 1", value)
    return count


def _bytes(key: str, value: Any) -> int:
    """A size >= 0: a whole number of bytes or text such as ``"48 MiB"``."""
    if isinstance(value, str):
        try:
            value = parse_bytes(value.strip().replace("_", ""))
        except (ValueError, TypeError):
            pass
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _refuse(key, 'a size >= 0 (bytes, or text such as "48 MiB")', value)
    return value


def _seconds(key: str, value: Any, *, positive: bool) -> float:
    """A duration: a number of seconds or text such as ``"250ms"`` or ``"1 minute"``."""
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = parse_timedelta(value.strip())
        except (ValueError, KeyError, TypeError):
            parsed = value
    bound = "> 0" if positive else ">= 0"
    if (
        isinstance(parsed, bool)
        or not isinstance(parsed, (int, float))
        or parsed != parsed  # NaN
        or parsed in (float("inf"), float("-inf"))
        or parsed < 0
        or (positive and parsed == 0)
    ):
        raise _refuse(key, f'a duration {bound} (seconds, or text such as "250ms")', value)
    return float(parsed)


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _flag(key: str, value: Any) -> bool:
    """A boolean; environment text ``true``/``false``, ``yes``/``no``, ``1``/``0``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _refuse(key, "true or false", value)


def _name(key: str, value: Any) -> str:
    """A non-empty name (a worker resource)."""
    if not isinstance(value, str) or not value.strip():
        raise _refuse(key, "a non-empty name", value)
    return value.strip()


def _directory(key: str, value: Any) -> str:
    """``"auto"`` or a directory path (not checked for existence here: it is the worker's)."""
    if not isinstance(value, str) or not value.strip():
        raise _refuse(key, '"auto" or a directory', value)
    return value.strip()


#: Values of ``rh-dask.gpu.device-loop``.
DEVICE_LOOP_MODES = ("auto", "on", "off")


def _device_loop(key: str, value: Any) -> str:
    """One of :data:`DEVICE_LOOP_MODES` (YAML's bare on/off arrive as booleans)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in DEVICE_LOOP_MODES:
        raise _refuse(key, " or ".join(f'"{m}"' for m in DEVICE_LOOP_MODES), value)
    return text


#: Values of ``rh-dask.relay.transport``.
RELAY_TRANSPORTS = ("auto", "tcp", "dask")


def _transport(key: str, value: Any) -> str:
    """One of :data:`RELAY_TRANSPORTS`."""
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in RELAY_TRANSPORTS:
        raise _refuse(key, " or ".join(f'"{t}"' for t in RELAY_TRANSPORTS), value)
    return text


def _size_or_auto(key: str, value: Any) -> int:
    """``"auto"`` (0) or a size >= 1."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    size = _bytes(key, value)
    if size < 1:
        raise _refuse(key, '"auto" or a size >= 1 (bytes, or text such as "128 MiB")', value)
    return size


def _fraction(key: str, value: Any) -> float:
    """A number within [0, 1); text as YAML or an environment variable leaves it."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= value < 1.0):
        raise _refuse(key, "a number within [0, 1)", value)
    return float(value)


def _threads_or_auto(key: str, value: Any) -> int | str:
    """``"auto"`` or a whole number >= 1."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        count = _whole(key, value)
    except SettingError:
        count = 0
    if count < 1:
        raise _refuse(key, '"auto" or a whole number >= 1', value)
    return count


def numpy_blas_threads() -> int | str:
    """The ``rh-dask.numpy.blas-threads`` setting, checked: ``"auto"`` or a count.

    Raises
    ------
    SettingError
        When the value is neither ``"auto"`` nor a whole number >= 1.
    """
    return _threads_or_auto(NUMPY_BLAS_THREADS, dask.config.get(NUMPY_BLAS_THREADS))


def grid_concurrent() -> bool:
    """The ``rh-dask.grid.concurrent`` setting, checked.

    Raises
    ------
    SettingError
        When the value is not a bool.
    """
    key = "rh-dask.grid.concurrent"
    return _flag(key, dask.config.get(key))


def zarr_direct() -> bool:
    """The ``rh-dask.readers.zarr-direct`` setting, checked.

    Raises
    ------
    SettingError
        When the value is not a bool.
    """
    return _flag(ZARR_DIRECT, dask.config.get(ZARR_DIRECT))


def in_process_max_rows() -> int:
    """The ``rh-dask.cli.in-process-max-rows`` setting, checked.

    Raises
    ------
    SettingError
        When the value is not a whole number ≥ 0.
    """
    return _whole(IN_PROCESS_MAX_ROWS, dask.config.get(IN_PROCESS_MAX_ROWS))


@dataclass(frozen=True)
class Settings:
    """Every setting of the ``rh-dask`` namespace, checked.

    Build it with :meth:`from_config`; the field defaults are the packaged
    defaults (``rh-dask.yaml``), for callers (tests, benchmarks) that build
    an actor without dask's configuration.

    Attributes
    ----------
    in_process_max_rows : int
        ``rh-dask.cli.in-process-max-rows``: with ``--scheduler auto``, inputs
        of fewer rows run in the command's own process.
    zarr_direct : bool
        ``rh-dask.readers.zarr-direct``: :func:`~rh_dask.read_zarr` decodes
        each batch's whole chunks straight into the batch where the array's
        codecs allow (:mod:`rh_dask.zarr_chunks`); read where it is called.
    poll_interval : float
        ``rh-dask.distributed.poll-interval``: seconds one progress poll of
        the engine's actor may wait on its worker before answering; also how
        often the client's progress bar moves and a lost worker is noticed.
    lookahead_max : int
        ``rh-dask.distributed.lookahead-max``: the most chunks
        ``lookahead="auto"`` keeps ahead of the engine when chunks load off
        its worker (``loader`` ``"relay"`` or ``"cluster"``: twice the
        chunks the loading workers may have in flight, their task threads
        or relayed file sends where more, at least 8, at most this).
    refill_every : int or "auto"
        ``rh-dask.distributed.refill-every``: with a task per chunk, the
        walk tops up the look-ahead each time this many more chunks have
        been consumed (``"auto"``: a quarter of the look-ahead, at least 1).
    pin_max_bytes : int
        ``rh-dask.distributed.pin-max-bytes``: chunks up to this size are
        copied into the engine's pinned pool (the GPU engine has one) on the
        loading threads; larger ones are staged by the engine (0: never).
    pin_mapped : bool
        ``rh-dask.distributed.pin-mapped``: chunks that are views of a
        memory-mapped file are pinned whatever their size.
    engine_keep : float
        ``rh-dask.distributed.engine-keep``: seconds an engine stays parked on
        its worker after a clean stream, for the next fit (0: closed).
    heap_for_chunks : bool
        ``rh-dask.distributed.heap-for-chunks``: while a stream runs, the
        engine's worker process serves chunk-sized allocations from malloc's
        heap (glibc's ``mallopt``; a process-wide change, restored when the
        stream ends). Off unless asked for.
    numpy_blas_threads : int or "auto"
        ``rh-dask.numpy.blas-threads``: threads of the NumPy engine's
        products, a count or ``"auto"`` (measured per batch class; each BLAS
        call on one thread, so no count changes a bit; docs/settings.md).
    gpu_graphs : bool
        ``rh-dask.gpu.graphs``: the GPU engine replays captured CUDA graphs.
    gpu_hold_gil : bool
        ``rh-dask.gpu.hold-gil``: the GPU engine's thread keeps the
        interpreter lock through its queueing CUDA calls.
    gpu_score_variance : bool
        ``rh-dask.gpu.score-variance``: the GPU engine accumulates the score
        variance K (standard errors, ``cov_``) at every batch.
    gpu_diagnostics : bool
        ``rh-dask.gpu.diagnostics``: the GPU engine reports each batch's robust
        diagnostics (mean Huber loss, share beyond τ, residual scale); off by
        default (they cost more than the solve).
    gpu_device_loop : {"auto", "on", "off"}
        ``rh-dask.gpu.device-loop``: the GPU engine runs a batch's Newton
        iterations as one CUDA graph loop on the device (one synchronisation
        per batch) where it can (``"auto"``), always (``"on"``) or never
        (``"off"``, the default: one per iteration).
    gpu_wide_kernels : bool
        ``rh-dask.gpu.wide-kernels``: the GPU engine runs the p-space work of
        designs with p ≥ 256 as grid kernels (on by default).
    gpu_pinned_idle_bytes : int
        ``rh-dask.gpu.pinned-idle-bytes``: the most bytes of pinned staging
        memory the process keeps idle per device for the next GPU engine
        (0: none kept, every engine pins and frees its own).
    checkpoint_every_chunks : int
        ``rh-dask.checkpoint.every-chunks``: during a Dask walk, the stream's
        state is copied off the engine's worker after every this many chunks.
    checkpoint_every_seconds : float
        ``rh-dask.checkpoint.every-seconds``: also after a chunk once this
        long has passed since the last stream checkpoint (0: by chunks only).
    max_retries : int
        ``rh-dask.recovery.max-retries``: recoveries from a lost engine worker
        allowed per call (0: the loss raises at once).
    worker_timeout : float
        ``rh-dask.recovery.worker-timeout``: seconds a recovery waits for a
        worker that can host the engine to appear.
    relay_resource : str
        ``rh-dask.relay.resource``: with ``loader="relay"``, the workers of
        the engine's node advertising this resource relay its chunks (when
        none does, all of that node's other workers); ``loader="auto"``
        relays only through workers advertising it.
    relay_directory : str
        ``rh-dask.relay.directory``: where the engine's worker makes the
        shared-memory chunk ring (``"auto"``: ``/dev/shm`` where it exists).
    relay_slot_bytes : int
        ``rh-dask.relay.slot-bytes``: bytes of one slot of the ring (0, from
        ``"auto"``: the largest chunk of an array stream, 128 MiB for a
        DataFrame stream; a larger chunk travels in a file of its own).
    relay_heap_for_chunks : bool
        ``rh-dask.relay.heap-for-chunks``: a relay worker's process serves
        chunk-sized allocations from malloc's heap while it relays a stream
        (restored when the last stream it relays ends).
    relay_transport : {"auto", "tcp", "dask"}
        ``rh-dask.relay.transport``: how loaded chunks reach the relays.
        ``"tcp"``: the loading worker sends them over a plain TCP connection
        (authenticated, not encrypted) straight into the ring;
        ``"dask"``: as task results over Dask's comm; ``"auto"``: ``"tcp"``
        unless Dask's comm must be encrypted
        (``distributed.comm.require-encryption``, a ``tls://`` scheduler).
    relay_pin_ring : bool
        ``rh-dask.relay.pin-ring``: a GPU engine's process page-locks the
        ring so that the engine copies chunks to its device straight from
        their slots (no host copy in its process).
    relay_keep_ring : bool
        ``rh-dask.relay.keep-ring``: after a clean stream the engine's worker
        keeps its ring with its parked engine (``engine_keep``), and the next
        stream of the same ring shape takes it, already allocated and
        page-locked; its file keeps its name meanwhile.
    relay_sendfile : bool
        ``rh-dask.relay.sendfile``: with the TCP transport, a chunk whose
        parts are :func:`~rh_dask.read_npy` arrays used as they are goes from
        the loading worker's page cache to the relay with ``sendfile``, in
        one task, and the relay validates it (off: it loads as a task first).
    relay_file_sends : int or "auto"
        ``rh-dask.relay.file-sends``: the sends of such chunks a loading
        worker keeps in flight; ``"auto"``: one per relay the loading
        workers share, at least 1 and at most 2 per task thread
        (:func:`~rh_dask.distributed.push.file_sends_per_loader`). Beyond
        its task threads, a worker's sends leave its thread pool.
    auto_calibrate : bool
        ``rh-dask.engine.auto.calibrate``: ``engine="auto"`` times NumPy
        against the GPU on the first batch's shape (off: NumPy unless a CUDA
        device is named or the batch is on one).
    grid_concurrent : bool
        ``rh-dask.grid.concurrent``: the GPU engines of a grid of
        configurations consume each batch side by side, their steps
        interleaved on one thread and waited for together (on by default:
        1.8-1.9x faster than one after the other on an H200,
        docs/performance.md).
    auto_probe_rows : int
        ``rh-dask.engine.auto.probe-rows``: rows each engine may consume in
        one calibration, warm-ups included (the probe sizes shrink to fit).
    auto_rounds : int
        ``rh-dask.engine.auto.rounds``: rounds per probe size, each two timed
        pairs (NumPy then GPU, GPU then NumPy).
    auto_allowance : float
        ``rh-dask.engine.auto.allowance``: the GPU is chosen when its
        predicted time is at most ``1 - allowance`` times NumPy's.
    auto_deadline : float
        ``rh-dask.engine.auto.deadline``: seconds after which a calibration
        stops and decides from the probe sizes it finished.
    auto_settle : float
        ``rh-dask.engine.auto.settle``: after a calibration that chose the
        GPU, the most seconds it waits for the BLAS threads its NumPy probes
        woke to go idle (0: it does not wait).
    """

    in_process_max_rows: int = 10_000_000
    zarr_direct: bool = True
    poll_interval: float = 0.25
    lookahead_max: int = 32
    refill_every: int | str = "auto"
    pin_max_bytes: int = 48 << 20
    pin_mapped: bool = True
    engine_keep: float = 60.0
    heap_for_chunks: bool = False
    numpy_blas_threads: int | str = "auto"
    gpu_graphs: bool = True
    gpu_hold_gil: bool = True
    gpu_score_variance: bool = True
    gpu_diagnostics: bool = False
    gpu_device_loop: str = "off"
    gpu_wide_kernels: bool = True
    gpu_pinned_idle_bytes: int = 256 << 20
    grid_concurrent: bool = True
    checkpoint_every_chunks: int = 16
    checkpoint_every_seconds: float = 60.0
    max_retries: int = 3
    worker_timeout: float = 60.0
    relay_resource: str = "relay"
    relay_directory: str = "auto"
    relay_slot_bytes: int = 0
    relay_heap_for_chunks: bool = False
    relay_transport: str = "auto"
    relay_pin_ring: bool = True
    relay_keep_ring: bool = True
    relay_sendfile: bool = True
    relay_file_sends: int | str = "auto"
    auto_calibrate: bool = True
    auto_probe_rows: int = 131_072
    auto_rounds: int = 3
    auto_allowance: float = 0.1
    auto_deadline: float = 2.0
    auto_settle: float = 0.5

    @classmethod
    def from_config(cls) -> Settings:
        """Read every setting from :mod:`dask.config` and check it.

        Raises
        ------
        SettingError
            Naming the first setting whose value it cannot take.
        """
        return cls(**{name: cls.read(name) for name in _KEYS})

    @staticmethod
    def read(name: str) -> Any:
        """One setting (a field's name), read from :mod:`dask.config` and checked.

        For a hot path that needs one value: :meth:`from_config` reads all of
        them (about 60 µs on the dev box).

        Raises
        ------
        SettingError
            When its value cannot be taken.
        """
        key, parse = _KEYS[name]
        return parse(key, dask.config.get(key))

    def engine_options(self, engine: str) -> dict[str, Any]:
        """Keyword options of ``engine``'s constructor that these settings decide."""
        if engine == "gpu":
            return {
                "graphs": self.gpu_graphs,
                "hold_gil": self.gpu_hold_gil,
                "score_variance": self.gpu_score_variance,
                "diagnostics": self.gpu_diagnostics,
                "device_loop": self.gpu_device_loop,
                "pinned_idle_bytes": self.gpu_pinned_idle_bytes,
                "wide_kernels": self.gpu_wide_kernels,
            }
        if engine == "numpy":
            return {"blas_threads": self.numpy_blas_threads}
        return {}


#: Field of :class:`Settings` -> its dask.config key and the check of its value.
_KEYS: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "in_process_max_rows": (IN_PROCESS_MAX_ROWS, _whole),
    "zarr_direct": (ZARR_DIRECT, _flag),
    "poll_interval": (
        "rh-dask.distributed.poll-interval",
        lambda key, value: _seconds(key, value, positive=True),
    ),
    "lookahead_max": ("rh-dask.distributed.lookahead-max", _count),
    "refill_every": ("rh-dask.distributed.refill-every", _threads_or_auto),
    "pin_max_bytes": ("rh-dask.distributed.pin-max-bytes", _bytes),
    "pin_mapped": ("rh-dask.distributed.pin-mapped", _flag),
    "engine_keep": (
        "rh-dask.distributed.engine-keep",
        lambda key, value: _seconds(key, value, positive=False),
    ),
    "heap_for_chunks": ("rh-dask.distributed.heap-for-chunks", _flag),
    "numpy_blas_threads": (NUMPY_BLAS_THREADS, _threads_or_auto),
    "gpu_graphs": ("rh-dask.gpu.graphs", _flag),
    "gpu_hold_gil": ("rh-dask.gpu.hold-gil", _flag),
    "gpu_score_variance": ("rh-dask.gpu.score-variance", _flag),
    "gpu_diagnostics": ("rh-dask.gpu.diagnostics", _flag),
    "gpu_device_loop": ("rh-dask.gpu.device-loop", _device_loop),
    "gpu_pinned_idle_bytes": ("rh-dask.gpu.pinned-idle-bytes", _bytes),
    "gpu_wide_kernels": ("rh-dask.gpu.wide-kernels", _flag),
    "grid_concurrent": ("rh-dask.grid.concurrent", _flag),
    "checkpoint_every_chunks": ("rh-dask.checkpoint.every-chunks", _count),
    "checkpoint_every_seconds": (
        "rh-dask.checkpoint.every-seconds",
        lambda key, value: _seconds(key, value, positive=False),
    ),
    "max_retries": ("rh-dask.recovery.max-retries", _whole),
    "worker_timeout": (
        "rh-dask.recovery.worker-timeout",
        lambda key, value: _seconds(key, value, positive=True),
    ),
    "relay_resource": ("rh-dask.relay.resource", _name),
    "relay_directory": ("rh-dask.relay.directory", _directory),
    "relay_slot_bytes": ("rh-dask.relay.slot-bytes", _size_or_auto),
    "relay_heap_for_chunks": ("rh-dask.relay.heap-for-chunks", _flag),
    "relay_transport": ("rh-dask.relay.transport", _transport),
    "relay_pin_ring": ("rh-dask.relay.pin-ring", _flag),
    "relay_keep_ring": ("rh-dask.relay.keep-ring", _flag),
    "relay_sendfile": ("rh-dask.relay.sendfile", _flag),
    "relay_file_sends": ("rh-dask.relay.file-sends", _threads_or_auto),
    "auto_calibrate": ("rh-dask.engine.auto.calibrate", _flag),
    "auto_probe_rows": ("rh-dask.engine.auto.probe-rows", _count),
    "auto_rounds": ("rh-dask.engine.auto.rounds", _count),
    "auto_allowance": ("rh-dask.engine.auto.allowance", _fraction),
    "auto_deadline": (
        "rh-dask.engine.auto.deadline",
        lambda key, value: _seconds(key, value, positive=True),
    ),
    "auto_settle": (
        "rh-dask.engine.auto.settle",
        lambda key, value: _seconds(key, value, positive=False),
    ),
}


def setting_keys() -> dict[str, str]:
    """Field of :class:`Settings` -> its ``dask.config`` key."""
    return {name: key for name, (key, _) in _KEYS.items()}


dask.config.update_defaults(defaults())
