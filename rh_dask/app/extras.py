"""Optional dependencies: import them on first use, or say in one line what to install.

The readers (pyarrow, zarr) and the report plots (matplotlib) live in the
``io`` and ``report`` extras, so that ``pip install rh-dask`` stays small.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..exceptions import MissingExtraError

__all__ = ["MissingExtraError", "require"]


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError`.

    Parameters
    ----------
    module : str
        Importable name, e.g. ``"pyarrow"``.
    extra : str
        The rh-dask extra that provides it, e.g. ``"io"``.
    purpose : str
        What needs it, completing "... needs <module>", e.g. ``"reading Parquet"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{purpose} needs {module}, which is not installed: pip install 'rh-dask[{extra}]'"
        ) from exc
