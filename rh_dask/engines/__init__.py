"""Engine registry and selection.

``engine="numpy"`` and ``engine="gpu"`` are explicit requests: if the engine
cannot start, :class:`~rh_dask.exceptions.EngineUnavailableError` says why,
and nothing is silently substituted. A stream that starts with
``engine="auto"`` is decided by :func:`rh_dask.engines.auto.choose_engine`
(in memory, in a Dask walk on the engine's worker, and on the command line
alike); :func:`resolve_engine_name` maps a name to an engine without
measuring, e.g. for a stream restored from a checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import HuberConfig
from ..exceptions import EngineUnavailableError, ValidationError
from .base import Engine
from .numpy_engine import NumpyEngine

if TYPE_CHECKING:  # pragma: no cover
    from ..settings import Settings

__all__ = ["ENGINE_NAMES", "Engine", "NumpyEngine", "make_engine", "resolve_engine_name"]

ENGINE_NAMES: tuple[str, ...] = ("auto", "numpy", "gpu")


def resolve_engine_name(
    engine: str, device: Any = None, *, gpu_workers: bool | None = None
) -> str:
    """The engine to run: ``"auto"`` mapped to a concrete name, the others validated.

    The rule for ``"auto"``: the GPU engine where the engine is known to have
    a GPU, else the NumPy engine. Where it is known comes first from the
    cluster, when the caller has asked it (``gpu_workers``: whether any
    worker advertises the ``GPU`` resource), and otherwise from ``device``:
    a CUDA device (``"cuda"``, ``"cuda:N"``) names the GPU engine. A stream
    that starts with ``engine="auto"`` is decided by measurement instead
    (:func:`rh_dask.engines.auto.choose_engine`).

    Parameters
    ----------
    engine : {"auto", "numpy", "gpu"}
    device : None, "cpu", "cuda", "cuda:N" or int
        The device the engine is asked to use.
    gpu_workers : bool, optional
        Whether the cluster the engine will run on has GPU workers; ``None``
        (the estimator's own calls): not asked, ``device`` decides.

    Returns
    -------
    str
        ``"numpy"`` or ``"gpu"``.

    Raises
    ------
    ValidationError
        When ``engine`` is not one of :data:`ENGINE_NAMES`.
    """
    if engine not in ENGINE_NAMES:
        raise ValidationError(f"engine must be one of {ENGINE_NAMES}, got {engine!r}")
    if engine != "auto":
        return engine
    if gpu_workers is not None:
        return "gpu" if gpu_workers else "numpy"
    if device is not None and str(device).startswith("cuda"):
        return "gpu"
    return "numpy"


def make_engine(
    engine: str, config: HuberConfig, device: Any = None, *, settings: Settings | None = None
) -> Engine:
    """Create an engine by name.

    Parameters
    ----------
    engine : {"auto", "numpy", "gpu"}
    config : HuberConfig
    device : None, "cpu", "cuda", "cuda:N" or int
        Where the engine should live (``None``: its default).
    settings : Settings, optional
        Decide the engines' options (``rh-dask.gpu.*``,
        ``rh-dask.numpy.blas-threads``); default: read from
        :mod:`dask.config` in this process when the engine is made.
        The engines themselves take plain arguments and never read it.

    Raises
    ------
    EngineUnavailableError
        When the requested engine or device cannot be used here.
    SettingError
        When a setting of the engine read from :mod:`dask.config` holds a
        value it cannot take.
    """
    name = resolve_engine_name(engine, device)
    if name == "numpy":
        from ..settings import numpy_blas_threads

        threads = numpy_blas_threads() if settings is None else settings.numpy_blas_threads
        cpu = None if device in (None, "cpu") else str(device)
        return NumpyEngine(config, device=cpu, blas_threads=threads)
    try:
        from gpu_engine import GpuEngine
    except ImportError as exc:  # CuPy or a CUDA runtime is missing
        raise EngineUnavailableError(
            f"engine='gpu' needs CuPy and a CUDA GPU: {exc}. Install rh-dask[gpu] "
            "on a machine with an NVIDIA GPU, or choose engine='numpy'."
        ) from exc
    if settings is None:
        from ..settings import Settings

        settings = Settings.from_config()
    return GpuEngine(config, device=device, **settings.engine_options("gpu"))
