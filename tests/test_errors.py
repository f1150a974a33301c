"""The error hierarchy: every error a user can cause is an RhDaskError importable from rh_dask."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import rh_dask
import rh_dask.exceptions as exceptions


def test_every_exception_of_rh_dask_exceptions_is_an_rh_dask_error_exported_by_rh_dask():
    assert exceptions.__all__
    for name in exceptions.__all__:
        cls = getattr(exceptions, name)
        assert isinstance(cls, type) and issubclass(cls, exceptions.RhDaskError), name
        assert name in rh_dask.__all__ and getattr(rh_dask, name) is cls, name


def test_every_exception_rh_dask_exports_is_an_rh_dask_error():
    exported = {
        name: getattr(rh_dask, name)
        for name in rh_dask.__all__
        if isinstance(getattr(rh_dask, name), type)
        and issubclass(getattr(rh_dask, name), BaseException)
    }
    assert {"ActorLostError", "SchedulerLostError", "BadChunkError"} <= set(exported)
    for name, cls in exported.items():
        assert issubclass(cls, rh_dask.RhDaskError), name


def _modules() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(rh_dask.__path__, prefix="rh_dask.")
        if info.name != "rh_dask.__main__"
    ]
    assert "rh_dask.distributed.coordinator" in names and "rh_dask.stream" in names
    return names


def _error_classes(module_name: str) -> list[type]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only the application may need optional extras; the library imports without them.
        if not module_name.startswith("rh_dask.app.") or (exc.name or "").startswith("rh_dask"):
            raise
        pytest.skip(f"{module_name} needs {exc.name}")
    return [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == module_name
    ]


@pytest.mark.parametrize("module_name", _modules())
def test_every_error_class_of_the_package_is_an_rh_dask_error(module_name):
    for cls in _error_classes(module_name):
        assert issubclass(cls, rh_dask.RhDaskError), f"{module_name}.{cls.__name__}"
        if not module_name.startswith("rh_dask.app."):
            # A library error is importable from the package's top level.
            assert getattr(rh_dask, cls.__name__, None) is cls, f"{module_name}.{cls.__name__}"


def test_actor_lost_error_is_one_class_wherever_it_is_imported_from():
    from rh_dask.distributed import ActorLostError as from_distributed
    from rh_dask.distributed.coordinator import ActorLostError as from_coordinator

    assert from_distributed is from_coordinator is rh_dask.ActorLostError
    assert issubclass(rh_dask.ActorLostError, rh_dask.StreamError)
    assert rh_dask.ActorLostError.__module__ == "rh_dask.exceptions"
