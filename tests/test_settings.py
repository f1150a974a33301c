"""The ``rh-dask`` settings: packaged defaults, dask.config, env vars, checks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import dask.config
import pytest
import yaml

import rh_dask
from rh_dask import HuberConfig, ValidationError
from rh_dask.engines import make_engine
from rh_dask.settings import SettingError, Settings, defaults, env_name, setting_keys

KEYS = setting_keys()


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_every_field_has_one_packaged_default_and_no_key_is_unlisted():
    assert set(KEYS) == {f.name for f in dataclasses.fields(Settings)}
    packaged = yaml.safe_load(
        Path(rh_dask.settings.__file__).with_name("rh-dask.yaml").read_text()
    )
    assert packaged == defaults()

    def leaves(tree, prefix):
        for name, value in tree.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    assert set(leaves(packaged, "")) == set(KEYS.values())
    for key in KEYS.values():
        assert dask.config.get(key) == _lookup(packaged, key)  # merged on import


def test_the_dataclass_defaults_are_the_packaged_ones():
    assert Settings.from_config() == Settings()
    assert Settings().pin_max_bytes == 48 * 2**20 and Settings().poll_interval == 0.25
    assert Settings().heap_for_chunks is False  # a process-wide change: only when asked


def test_values_are_read_from_dask_config_and_text_is_parsed():
    with dask.config.set(
        {
            "rh-dask.distributed.poll-interval": "50ms",
            "rh-dask.distributed.pin-max-bytes": "1 MiB",
            "rh-dask.distributed.pin-mapped": "false",
            "rh-dask.distributed.engine-keep": 0,
            "rh-dask.distributed.heap-for-chunks": "yes",
            "rh-dask.gpu.graphs": False,
            "rh-dask.gpu.hold-gil": "0",
            "rh-dask.gpu.score-variance": "no",
            "rh-dask.gpu.diagnostics": "on",
            "rh-dask.gpu.pinned-idle-bytes": "64 MiB",
            "rh-dask.cli.in-process-max-rows": "1_000",
            "rh-dask.numpy.blas-threads": "3",
            "rh-dask.distributed.refill-every": "2",
            "rh-dask.distributed.lookahead-max": "12",
        }
    ):
        settings = Settings.from_config()
    assert settings == Settings(
        in_process_max_rows=1_000,
        poll_interval=0.05,
        pin_max_bytes=2**20,
        pin_mapped=False,
        engine_keep=0.0,
        heap_for_chunks=True,
        gpu_graphs=False,
        gpu_hold_gil=False,
        gpu_score_variance=False,
        gpu_diagnostics=True,
        gpu_pinned_idle_bytes=64 * 2**20,
        numpy_blas_threads=3,
        refill_every=2,
        lookahead_max=12,
    )
    assert settings.engine_options("gpu") == {
        "graphs": False,
        "hold_gil": False,
        "score_variance": False,
        "diagnostics": True,
        "device_loop": "off",
        "pinned_idle_bytes": 64 * 2**20,
        "wide_kernels": True,
    }
    assert settings.engine_options("numpy") == {"blas_threads": 3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.pin_mapped = True  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("poll_interval", 0, "a duration > 0"),
        ("poll_interval", "soon", "a duration > 0"),
        ("poll_interval", float("nan"), "a duration > 0"),
        ("engine_keep", -1, "a duration >= 0"),
        ("auto_settle", -1, "a duration >= 0"),
        ("auto_settle", "later", "a duration >= 0"),
        ("engine_keep", True, "a duration >= 0"),
        ("pin_max_bytes", -5, "a size >= 0"),
        ("pin_max_bytes", "lots", "a size >= 0"),
        ("pin_max_bytes", 1.5, "a size >= 0"),
        ("pin_mapped", "maybe", "true or false"),
        ("heap_for_chunks", 2, "true or false"),
        ("gpu_graphs", None, "true or false"),
        ("gpu_hold_gil", "", "true or false"),
        ("gpu_score_variance", "x", "true or false"),
        ("gpu_diagnostics", "x", "true or false"),
        ("gpu_device_loop", "sometimes", '"auto" or "on" or "off"'),
        ("gpu_wide_kernels", "yes please", "true or false"),
        ("in_process_max_rows", -1, "a whole number >= 0"),
        ("numpy_blas_threads", 0, '"auto" or a whole number >= 1'),
        ("numpy_blas_threads", "all", '"auto" or a whole number >= 1'),
        ("lookahead_max", 0, "a whole number >= 1"),
        ("lookahead_max", "many", "a whole number >= 1"),
        ("refill_every", 0, '"auto" or a whole number >= 1'),
        ("refill_every", "often", '"auto" or a whole number >= 1'),
        ("relay_file_sends", 0, '"auto" or a whole number >= 1'),
        ("relay_file_sends", "many", '"auto" or a whole number >= 1'),
    ],
)
def test_a_malformed_value_is_refused_naming_its_key(field, value, expected):
    key = KEYS[field]
    with dask.config.set({key: value}), pytest.raises(SettingError) as err:
        Settings.from_config()
    message = str(err.value)
    assert message.startswith(f"setting {key} ({env_name(key)}) must be {expected}")
    assert message.endswith(f"got {value!r}")
    assert isinstance(err.value, ValidationError) and isinstance(err.value, ValueError)


def test_env_names_follow_dasks_convention():
    assert env_name("rh-dask.distributed.pin-max-bytes") == (
        "DASK_RH_DASK__DISTRIBUTED__PIN_MAX_BYTES"
    )
    assert env_name("rh-dask.gpu.hold-gil") == "DASK_RH_DASK__GPU__HOLD_GIL"


def test_environment_variables_set_the_settings_on_import():
    program = (
        "from rh_dask.settings import Settings; s = Settings.from_config(); "
        "print(s.pin_max_bytes, s.engine_keep, s.gpu_graphs, s.heap_for_chunks)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env |= {
        "DASK_RH_DASK__DISTRIBUTED__PIN_MAX_BYTES": "0",
        "DASK_RH_DASK__DISTRIBUTED__ENGINE_KEEP": "5s",
        "DASK_RH_DASK__GPU__GRAPHS": "False",
        "DASK_RH_DASK__DISTRIBUTED__HEAP_FOR_CHUNKS": "true",
    }
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.stdout.split() == ["0", "5.0", "False", "True"], run.stderr


class _GpuEngine:
    """Stands in for ``gpu_engine.GpuEngine`` (its constructor's signature)."""

    def __init__(
        self,
        config,
        device=None,
        *,
        graphs=True,
        hold_gil=True,
        score_variance=True,
        diagnostics=False,
        device_loop="off",
        pinned_idle_bytes=None,
        wide_kernels=True,
    ):
        self.config, self.device, self.graphs, self.hold_gil = config, device, graphs, hold_gil
        self.score_variance, self.diagnostics = score_variance, diagnostics
        self.device_loop = device_loop
        self.pinned_idle_bytes = pinned_idle_bytes
        self.wide_kernels = wide_kernels


def test_make_engine_passes_the_gpu_settings_to_the_constructor(monkeypatch):
    import inspect

    from gpu_engine.engine import GpuEngine

    defaults = {"graphs": True, "hold_gil": True, "score_variance": True, "diagnostics": False}
    real = inspect.signature(GpuEngine).parameters
    stand_in = inspect.signature(_GpuEngine).parameters
    assert all(real[k].default == stand_in[k].default is v for k, v in defaults.items())
    assert all(getattr(Settings(), f"gpu_{k}") is v for k, v in defaults.items())
    # The device loop is off (slower on the H200); the wide designs' grid kernels are on.
    assert real["device_loop"].default == stand_in["device_loop"].default == "off"
    assert Settings().gpu_device_loop == "off"
    assert real["wide_kernels"].default is stand_in["wide_kernels"].default is True
    assert Settings().gpu_wide_kernels is True
    fake = types.ModuleType("gpu_engine")
    fake.GpuEngine = engine_class = _GpuEngine
    monkeypatch.setitem(sys.modules, "gpu_engine", fake)
    explicit = Settings(
        gpu_graphs=False,
        gpu_hold_gil=False,
        gpu_score_variance=False,
        gpu_diagnostics=True,
        gpu_pinned_idle_bytes=0,
        gpu_wide_kernels=False,
    )
    engine = make_engine("gpu", HuberConfig(), "cuda:0", settings=explicit)
    assert isinstance(engine, engine_class) and engine.device == "cuda:0"
    assert engine.graphs is False and engine.hold_gil is False
    assert engine.score_variance is False and engine.diagnostics is True
    assert engine.device_loop == "off" and engine.wide_kernels is False
    looped = make_engine(
        "gpu", HuberConfig(), settings=Settings(gpu_device_loop="auto", gpu_wide_kernels=True)
    )
    assert looped.device_loop == "auto" and looped.wide_kernels is True
    assert engine.pinned_idle_bytes == 0
    assert "pinned_idle_bytes" in real  # the real constructor takes it too
    with dask.config.set({"rh-dask.gpu.graphs": False}):  # read here when not given
        engine = make_engine("gpu", HuberConfig())
    assert engine.graphs is False and engine.hold_gil is True
    assert engine.pinned_idle_bytes == 256 * 2**20
    with dask.config.set({"rh-dask.gpu.graphs": "often"}), pytest.raises(SettingError):
        make_engine("gpu", HuberConfig())
    with dask.config.set({"rh-dask.gpu.graphs": "often"}):
        assert make_engine("numpy", HuberConfig()).name == "numpy"  # not read for NumPy


def test_a_grid_without_settings_reads_its_concurrency_from_dask_config():
    from rh_dask.engines.grid import GridEngine
    from rh_dask.settings import grid_concurrent

    assert grid_concurrent() is True  # the packaged default
    with dask.config.set({"rh-dask.grid.concurrent": False}):
        assert grid_concurrent() is False
    with dask.config.set({"rh-dask.grid.concurrent": "sometimes"}):
        with pytest.raises(SettingError, match=r"rh-dask\.grid\.concurrent"):
            GridEngine([HuberConfig(tau=1.0), HuberConfig(tau=2.0)])


def test_one_setting_is_read_and_checked_as_from_config_reads_it():
    assert Settings.read("auto_calibrate") is Settings.from_config().auto_calibrate is True
    with dask.config.set({"rh-dask.engine.auto.calibrate": "false"}):
        assert Settings.read("auto_calibrate") is False
    with dask.config.set({"rh-dask.engine.auto.calibrate": "maybe"}):
        with pytest.raises(SettingError, match=r"rh-dask\.engine\.auto\.calibrate"):
            Settings.read("auto_calibrate")
