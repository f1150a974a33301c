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

from gpu_engine import kernels, layout

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


def _compile(ctype: str, arch: str) -> tuple[int, str, int]:
    """(NVRTC status, compile log, size of the machine code) for one dtype."""
    lib = NVRTC
    code = (layout.cuda_defines() + kernels.SOURCE.read_text()).encode()
    program = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(program), code, b"huber.cu", 0, None, None) == 0
    try:
        for name in kernels.KERNEL_NAMES:
            assert lib.nvrtcAddNameExpression(program, f"{name}<{ctype}>".encode()) == 0
        options = [o.encode() for o in kernels.COMPILE_OPTIONS] + [
            f"--gpu-architecture={arch}".encode()
        ]
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


def test_a_broken_source_fails_to_compile(monkeypatch, tmp_path):
    broken = tmp_path / "huber.cu"
    broken.write_text(kernels.SOURCE.read_text() + "\nthis is not C++;\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    status, log, _ = _compile("float", ARCHITECTURES[0])
    assert status != 0 and "error" in log
