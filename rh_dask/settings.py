"""rh-dask's settings in :mod:`dask.config`, under the ``rh-dask`` namespace.

The defaults ship with the package (``rh-dask.yaml`` beside this module)
and are merged into dask's configuration when :mod:`rh_dask` is imported,
the way ``distributed`` adds its own; a user's dask YAML files,
``dask.config.set`` and ``DASK_RH_DASK__...`` environment variables
override them.
"""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

from .exceptions import RhDaskError

__all__ = ["IN_PROCESS_MAX_ROWS", "SettingError", "defaults", "in_process_max_rows"]

#: Rows below which ``--scheduler auto`` runs a command in this process.
IN_PROCESS_MAX_ROWS = "rh-dask.cli.in-process-max-rows"

_DEFAULTS_FILE = os.path.join(os.path.dirname(__file__), "rh-dask.yaml")


class SettingError(RhDaskError, ValueError):
    """A setting of the ``rh-dask`` namespace holds a value it cannot take."""


def defaults() -> dict[str, Any]:
    """The packaged defaults (``rh-dask.yaml``) as a nested dict."""
    with open(_DEFAULTS_FILE, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def _env_name(key: str) -> str:
    return "DASK_" + "__".join(part.replace("-", "_").upper() for part in key.split("."))


def in_process_max_rows() -> int:
    """The ``rh-dask.cli.in-process-max-rows`` setting, checked.

    Raises
    ------
    SettingError
        When the value is not a whole number ≥ 0.
    """
    value = dask.config.get(IN_PROCESS_MAX_ROWS)
    if isinstance(value, str):  # a YAML or environment value dask left as text
        value = value.strip().replace("_", "")
        value = int(value) if value.isdigit() else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingError(
            f"setting {IN_PROCESS_MAX_ROWS} ({_env_name(IN_PROCESS_MAX_ROWS)}) must be a "
            f"whole number >= 0, got {value!r}"
        )
    return value


dask.config.update_defaults(defaults())
