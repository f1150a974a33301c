"""Dense linear algebra of the Newton step: cuBLAS and cuSOLVER, low level.

The per-iteration calls go straight to CuPy's thin bindings of cuBLAS and
cuSOLVER (no CuPy array machinery, no allocation, no synchronisation): one
GEMM for the Gram matrix and the gradient together, ``potrf``/``potrs`` on a
workspace allocated once per parameter count. The handles are the engine's
own, bound to its stream, in the default (IEEE) math mode: no TF32 whatever
``CUPY_TF32`` says. Handles are pooled per device because creating a
cuSOLVER handle costs milliseconds.

The rest of the contract's solve ladder (LU, then the minimum-norm
least-squares solution from the symmetric eigendecomposition) runs only when
the Cholesky factor fails the scale-invariant singularity test on the device;
it is prepared lazily and synchronises freely, since it is the rare path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

_POOL_LOCK = threading.Lock()
_POOL: dict[int, list[tuple[int, int]]] = {}


def _loaded_library(stem: str) -> ctypes.CDLL:
    """The copy of ``lib<stem>.so`` that CuPy has loaded (so handles are shared).

    The per-iteration calls go through ctypes rather than CuPy's bindings:
    CuPy refuses cuBLAS calls while a stream is being captured into a CUDA
    graph, while cuBLAS and cuSOLVER themselves support capture.
    """
    prefix = f"lib{stem}.so"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith(prefix):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    found = ctypes.util.find_library(stem)
    if found is None:
        raise OSError(f"{prefix} is not loaded and cannot be found")
    return ctypes.CDLL(found)


_FUNCS_LOCK = threading.Lock()
_FUNCS: dict[str, Any] = {}


def _library_calls(prefix: str) -> tuple[Any, Any, Any]:
    """ctypes entry points (gemm, potrf, potrs) for the dtype prefix 's' or 'd'."""
    with _FUNCS_LOCK:
        if prefix not in _FUNCS:
            blas, lapack = _loaded_library("cublas"), _loaded_library("cusolver")
            vp, i = ctypes.c_void_p, ctypes.c_int
            gemm = getattr(blas, f"cublas{prefix.upper()}gemm_v2")
            gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, vp, i, vp, vp, i]
            potrf = getattr(lapack, f"cusolverDn{prefix.upper()}potrf")
            potrf.argtypes = [vp, i, i, vp, i, vp, i, vp]
            potrs = getattr(lapack, f"cusolverDn{prefix.upper()}potrs")
            potrs.argtypes = [vp, i, i, i, vp, i, vp, i, vp]
            for fn in (gemm, potrf, potrs):
                fn.restype = ctypes.c_int
            _FUNCS[prefix] = (gemm, potrf, potrs)
        return _FUNCS[prefix]


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with status {status}")


def _acquire_handles(device_id: int) -> tuple[int, int]:
    from cupy_backends.cuda.libs import cublas, cusolver

    with _POOL_LOCK:
        free = _POOL.setdefault(device_id, [])
        if free:
            return free.pop()
    return cublas.create(), cusolver.create()


def _release_handles(device_id: int, handles: tuple[int, int]) -> None:
    with _POOL_LOCK:
        _POOL.setdefault(device_id, []).append(handles)


class DenseSolver:
    """cuBLAS/cuSOLVER calls of one engine, bound to its stream.

    Parameters
    ----------
    cp : module
        CuPy.
    device_id : int
        The engine's device (current when this is constructed).
    stream : cupy.cuda.Stream
        The engine's compute stream.
    dtype : numpy.dtype
        float32 or float64.
    """

    def __init__(self, cp: ModuleType, device_id: int, stream: Any, dtype: np.dtype) -> None:
        from cupy_backends.cuda.libs import cublas, cusolver

        self._cp = cp
        self._cublas = cublas
        self._cusolver = cusolver
        self.device_id = device_id
        self.dtype = np.dtype(dtype)
        self._handles: tuple[int, int] | None = _acquire_handles(device_id)
        self.blas, self.lapack = self._handles
        cublas.setStream(self.blas, stream.ptr)
        cublas.setPointerMode(self.blas, cublas.CUBLAS_POINTER_MODE_HOST)
        # Strict IEEE float32/float64: never TF32 or other reduced-precision modes.
        cublas.setMathMode(self.blas, cublas.CUBLAS_DEFAULT_MATH)
        cusolver.setStream(self.lapack, stream.ptr)
        prefix = "s" if self.dtype == np.float32 else "d"
        self._gemm, self._potrf, self._potrs = _library_calls(prefix)
        self._potrf_size = getattr(cusolver, f"{prefix}potrf_bufferSize")
        self._getrf = getattr(cusolver, f"{prefix}getrf")
        self._getrf_size = getattr(cusolver, f"{prefix}getrf_bufferSize")
        self._getrs = getattr(cusolver, f"{prefix}getrs")
        # Host scalars for pointer mode HOST (read at call or capture time).
        self._one = np.ones(1, dtype=self.dtype)
        self._zero = np.zeros(1, dtype=self.dtype)
        self._p = 0
        self._work: Any = None
        self._lwork = 0
        self._lu: Any = None

    @property
    def math_mode(self) -> int:
        """The cuBLAS math mode of the engine's handle (tests check it is the default)."""
        return int(self._cublas.getMathMode(self.blas))

    def prepare(self, p: int, H: Any) -> None:
        """Size the Cholesky workspace for p×p systems (once per parameter count)."""
        if p == self._p:
            return
        lwork = int(
            self._potrf_size(self.lapack, self._cublas.CUBLAS_FILL_MODE_LOWER, p, H.data.ptr, p)
        )
        self._work = self._cp.empty(max(lwork, 1), dtype=self.dtype)
        self._lwork = max(lwork, 1)
        self._lu = None  # the LU fallback workspace is prepared lazily
        self._p = p

    def gram_and_gradient(
        self, Z: Any, ldz: int, M: Any, ldm: int, C: Any, n: int, p: int
    ) -> None:
        """C (p × (p+1), column-major) = Zᵀ M over the first n rows, one GEMM.

        Z and M are row-major n×ldz and n×ldm, i.e. column-major ldz×n and
        ldm×n: C = Z_cm · M_cmᵀ gives Zᵀ diag(wκ) Z in its first p columns and
        Zᵀ(wψ) in the last.
        """
        cb = self._cublas
        self._product(cb.CUBLAS_OP_N, cb.CUBLAS_OP_T, p, p + 1, n, Z, ldz, M, ldm, False, C, p)

    def matvec(self, Z: Any, ldz: int, v: Any, out: Any, n: int, p: int) -> None:
        """``out[:n]`` = Z v over the first n rows of the row-major n×ldz ``Z``, one GEMM."""
        cb = self._cublas
        self._product(cb.CUBLAS_OP_T, cb.CUBLAS_OP_N, n, 1, p, Z, ldz, v, p, False, out, n)

    def gram(self, S: Any, lds: int, out: Any, n: int, p: int, accumulate: bool = False) -> None:
        """``out`` (p × p) = Sᵀ S over the first n rows and p columns of ``S`` (or ``+=`` it).

        ``S`` is row-major n×lds. Through the engine's own handle, bound to
        its stream: a library handle shared by streams that run at the same
        time (CuPy's, per thread) may pick other internal implementations,
        and so other bits, than it picks for a stream running alone.
        """
        cb = self._cublas
        self._product(cb.CUBLAS_OP_N, cb.CUBLAS_OP_T, p, p, n, S, lds, S, lds, accumulate, out, p)

    def _product(
        self,
        op_a: int,
        op_b: int,
        m: int,
        n: int,
        k: int,
        A: Any,
        lda: int,
        B: Any,
        ldb: int,
        accumulate: bool,
        C: Any,
        ldc: int,
    ) -> None:
        """One column-major ``gemm`` on the engine's handle: C = op(A) op(B) (+ C)."""
        status = self._gemm(
            self.blas,
            op_a,
            op_b,
            m,
            n,
            k,
            self._one.ctypes.data,
            A.data.ptr,
            lda,
            B.data.ptr,
            ldb,
            (self._one if accumulate else self._zero).ctypes.data,
            C.data.ptr,
            ldc,
        )
        _check(status, "cuBLAS gemm")

    def cholesky_solve(self, H: Any, D: Any, p: int, info_ptr: int, solve_info_ptr: int) -> None:
        """Factorise H in place (lower) and overwrite D with H⁻¹D; infos on the device."""
        lower = self._cublas.CUBLAS_FILL_MODE_LOWER
        self._potrf(
            self.lapack, lower, p, H.data.ptr, p, self._work.data.ptr, self._lwork, info_ptr
        )
        self._potrs(self.lapack, lower, p, 1, H.data.ptr, p, D.data.ptr, p, solve_info_ptr)

    def fallback_direction(self, Hs: Any, g: Any, p: int, rtol: float) -> Any:
        """LU, then the minimum-norm solution: the rest of the contract's ladder (synchronises).

        Parameters
        ----------
        Hs : cupy.ndarray, shape (p, p)
            The Newton matrix (exactly symmetric).
        g : cupy.ndarray, shape (p,)
            The gradient.
        p : int
            Parameter count.
        rtol : float
            :func:`rh_dask.core.singular_rtol` of the dtype and p.

        Returns
        -------
        cupy.ndarray, shape (p,)
            A finite direction D with Hs D = g (or its minimum-norm least-squares solution).
        """
        cp = self._cp
        # The eigendecomposition and products below go through CuPy's library
        # handles, which every stream of this thread shares; cuBLAS and cuSOLVER
        # keep their results bit-reproducible only while one stream is active
        # (the engines of a grid run side by side). This rare rung therefore
        # waits for the whole device first and for its own stream at the end.
        cp.cuda.Device(self.device_id).synchronize()
        try:
            return self._fallback_direction(Hs, g, p, rtol)
        finally:
            cp.cuda.get_current_stream().synchronize()

    def _fallback_direction(self, Hs: Any, g: Any, p: int, rtol: float) -> Any:
        cp = self._cp
        if self._lu is None:
            lwork = int(self._getrf_size(self.lapack, p, p, Hs.data.ptr, p))
            self._lu = (
                cp.empty((p, p), dtype=self.dtype),
                cp.empty(max(lwork, 1), dtype=self.dtype),
                cp.empty(p, dtype=np.int32),
                cp.empty(2, dtype=np.int32),
            )
        lu, work, ipiv, info = self._lu
        lu[...] = Hs  # symmetric: row- and column-major layouts agree
        self._getrf(self.lapack, p, p, lu.data.ptr, p, work.data.ptr, ipiv.data.ptr, info.data.ptr)
        u_diag = cp.abs(cp.diagonal(lu)).get()
        scale = float(cp.max(cp.abs(cp.diagonal(Hs))).get()) if p else 0.0
        if scale > 0 and np.all(u_diag > rtol * scale):
            direction = g.copy()
            self._getrs(
                self.lapack,
                self._cublas.CUBLAS_OP_N,
                p,
                1,
                lu.data.ptr,
                p,
                ipiv.data.ptr,
                direction.data.ptr,
                p,
                info[1:].data.ptr,
            )
            if bool(cp.all(cp.isfinite(direction)).get()):
                return direction
        # The minimum-norm solution through the symmetric eigendecomposition
        # Hs = V Λ Vᵀ: its singular values are |λ|, so Hs⁺ = V Λ⁺ Vᵀ with the
        # reference's SVD cut-off on |λ|. cuSOLVER's syevd is 10-11x faster than
        # its gesvd here (H200: p = 1025, float32, 11 against 120 ms; p = 2049,
        # 25 against 278 ms), and a float32 wide stream's first batch may take
        # this rung in most of its iterations.
        lam, vecs = cp.linalg.eigh(Hs)
        size = cp.abs(lam)
        cutoff = rtol * float(size.max().get()) if size.size else 0.0
        keep = size > cutoff
        inv = cp.where(keep, 1 / cp.where(keep, lam, 1), 0).astype(self.dtype)
        return (vecs @ (inv * (vecs.T @ g))).astype(self.dtype, copy=False)

    def close(self) -> None:
        """Give the handles back to the per-device pool."""
        if self._handles is not None:
            _release_handles(self.device_id, self._handles)
            self._handles = None
