"""The GPU engine's CUDA source compiles, on a machine without a GPU.

NVRTC needs no device: the test compiles ``gpu_engine/kernels/huber.cu``
exactly as :class:`gpu_engine.kernels.Kernels` does (the layout defines
prepended, the same options and name expressions, both dtypes) down to
machine code for the H200's architecture, so a CUDA syntax, template or
resource error fails CI instead of the first run on a GPU. NVRTC comes from
the ``nvidia-cuda-nvrtc`` wheel of the dev extra (Linux x86-64 only); the
test is skipped where the library cannot be found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import re
from pathlib import Path

import pytest

from gpu_engine import grid, kernels, layout

#: The architecture the engine's kernels must build for (H100/H200: sm_90).
ARCHITECTURES = ("sm_90",)


def _find_nvrtc() -> ctypes.CDLL | None:
    candidates: list[str] = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidates += sorted(str(p) for p in Path(root).glob("cu*/lib/libnvrtc.so*"))
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


NVRTC = _find_nvrtc()
pytestmark = pytest.mark.skipif(NVRTC is None, reason="NVRTC (nvidia-cuda-nvrtc) is not installed")


def _compile(
    ctype: str,
    arch: str,
    source: Path | None = None,
    expressions: tuple[str, ...] | None = None,
    compile_options: tuple[str, ...] = kernels.COMPILE_OPTIONS,
) -> tuple[int, str, int]:
    """(NVRTC status, compile log, size of the machine code) for one dtype.

    By default the engine's ``huber.cu`` with its kernels' name expressions;
    ``source``, ``expressions`` and ``compile_options`` compile another file.
    """
    lib = NVRTC
    source = kernels.SOURCE if source is None else source
    if expressions is None:
        expressions = tuple(f"{name}<{ctype}>" for name in kernels.KERNEL_NAMES)
    code = (layout.cuda_defines() + source.read_text()).encode()
    program = ctypes.c_void_p()
    assert (
        lib.nvrtcCreateProgram(ctypes.byref(program), code, source.name.encode(), 0, None, None)
        == 0
    )
    try:
        for expression in expressions:
            assert lib.nvrtcAddNameExpression(program, expression.encode()) == 0
        options = [o.encode() for o in compile_options] + [f"--gpu-architecture={arch}".encode()]
        status = lib.nvrtcCompileProgram(
            program, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        binary = ctypes.c_size_t(0)
        if status == 0:
            assert lib.nvrtcGetCUBINSize(program, ctypes.byref(binary)) == 0
        return status, log.value.decode(errors="replace"), binary.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_the_kernels_compile_for_both_dtypes(ctype, arch):
    status, log, cubin_bytes = _compile(ctype, arch)
    assert status == 0, f"NVRTC could not compile huber.cu for {ctype} on {arch}:\n{log}"
    assert cubin_bytes > 0
    # Warnings other than unused helpers (the other dtype's overloads) point at real mistakes.
    warnings = [
        line
        for line in log.splitlines()
        if re.search(r"warning #\d+", line) and "#177-D" not in line
    ]
    assert not warnings, "\n".join(warnings)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_the_grid_scoring_kernels_compile_for_both_dtypes(ctype, arch):
    """``kernels/score.cu`` as :func:`gpu_engine.grid.score_kernels` compiles it."""
    status, log, cubin_bytes = _compile(
        ctype,
        arch,
        grid.SOURCE,
        (f"rh_score_rows<{ctype}>", "rh_score_finish"),
        grid.COMPILE_OPTIONS,
    )
    assert status == 0, f"NVRTC could not compile score.cu for {ctype} on {arch}:\n{log}"
    assert cubin_bytes > 0
    assert not re.findall(r"warning #\d+.*", log), log


def test_a_broken_source_fails_to_compile(monkeypatch, tmp_path):
    broken = tmp_path / "huber.cu"
    broken.write_text(kernels.SOURCE.read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    status, log, _ = _compile("float", ARCHITECTURES[0])
    assert status != 0 and "error" in log


def _static_shared(ctype: str) -> dict[str, int]:
    """Static shared memory of every kernel (bytes), from the PTX NVRTC makes for sm_90."""
    lib = NVRTC
    code = (layout.cuda_defines() + kernels.SOURCE.read_text()).encode()
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code, b"huber.cu", 0, None, None) == 0
    try:
        for name in kernels.KERNEL_NAMES:
            assert lib.nvrtcAddNameExpression(program, f"{name}<{ctype}>".encode()) == 0
        options = [o.encode() for o in kernels.COMPILE_OPTIONS] + [
            b"--gpu-architecture=compute_90"
        ]
        status = lib.nvrtcCompileProgram(
            program, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        assert status == 0
        lowered = {}
        for name in kernels.KERNEL_NAMES:
            out = ctypes.c_char_p()
            assert (
                lib.nvrtcGetLoweredName(program, f"{name}<{ctype}>".encode(), ctypes.byref(out))
                == 0
            )
            lowered[out.value.decode()] = name
        size = ctypes.c_size_t()
        assert lib.nvrtcGetPTXSize(program, ctypes.byref(size)) == 0
        text = ctypes.create_string_buffer(size.value)
        assert lib.nvrtcGetPTX(program, text) == 0
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
    shared = {}
    # Each entry's shared arrays are declared inside its body (demoted to function scope).
    for entry in re.finditer(r"\.entry (\S+)\((.*?)\n\}\n", text.value.decode(), re.S):
        if entry.group(1) in lowered:
            sizes = re.findall(r"\.shared \.align \d+ \.b8 \S+\[(\d+)\]", entry.group(2))
            shared[lowered[entry.group(1)]] = sum(int(s) for s in sizes)
    assert set(shared) == set(kernels.KERNEL_NAMES)
    return shared


@pytest.mark.parametrize("ctype", ["float", "double"])
def test_static_shared_memory_fits_the_margins_the_launchers_leave(ctype):
    """Dynamic sizes are checked against the device limit less a margin for static arrays."""
    shared = _static_shared(ctype)
    margin = 8 * 1024  # lamm.py (eval, trials) and newton.py (the one-block solves)
    for name in ("rh_lamm_eval", "rh_lamm_trials", "rh_lamm_trials_wide"):
        assert shared[name] <= margin, (name, shared[name])
    for name in ("rh_newton_solve", "rh_newton_solve_blocked"):
        assert shared[name] <= margin, (name, shared[name])
    # lamm.py's wide gate: the strip sums plus 1 KiB
    strips = layout.LAMM_ROUND * (layout.ROW_THREADS // 32) * 32 * 8
    assert shared["rh_wide_lamm_symv"] <= strips + 1024


class _FakeFunction:
    """A kernel's dynamic shared-memory limit, counting the driver calls made for it."""

    def __init__(self, static: int) -> None:
        self._limit = 48 * 1024 - static  # the driver's default: 48 KiB less the static arrays
        self.reads = 0
        self.writes: list[int] = []

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        self.reads += 1
        return self._limit

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.writes.append(value)
        self._limit = value


def test_allow_shared_raises_a_limit_below_48_KiB_and_caches_it():
    k = kernels.Kernels.__new__(kernels.Kernels)
    fn = _FakeFunction(static=32 * 1024)
    k.__dict__.update(functions={"strips": fn}, _dynamic_limits={})
    k.allow_shared("strips", 8 * 1024)  # within the default: read once, untouched
    assert (fn.reads, fn.writes) == (1, [])
    k.allow_shared("strips", 38 * 1024)  # under 48 KiB but over this kernel's default
    assert (fn.reads, fn.writes) == (1, [38 * 1024])
    k.allow_shared("strips", 30 * 1024)  # the cached limit answers: no driver call
    assert (fn.reads, fn.writes) == (1, [38 * 1024])
