"""Layout of the control block the host and the kernels share.

One small device buffer (``ctl``) carries everything a batch's kernels need
besides the data: the batch's scalar parameters (written by the host once per
batch, so that captured CUDA graphs stay valid across batches) and the
solver's running state (step size, φ, counters, flags), which the kernels
update on the device so that the host only has to *read* a few numbers per
iteration. The finalising block of each iterating kernel copies the whole
buffer into a host-mapped status buffer, which is what the host reads after
its one synchronisation per iteration.

The buffer is ``N_DOUBLE`` float64 values followed by ``N_INT`` int32 values.
This module is the single source of the indices: :func:`cuda_defines` turns
them into ``#define`` lines prepended to the CUDA source.
"""

from __future__ import annotations

import math

from rh_dask.core import MIN_STEP

# -- parameters (float64, written by the host before a batch) ------------------
P_TAU = 0  #: τ rounded to the compute dtype
P_HALF_INV_H = 1  #: 0.5 / h rounded to the compute dtype
P_INV_TOTAL = 2  #: 1 / N rounded to the compute dtype
P_TOTAL = 3  #: N (float64)
P_RIDGE = 4  #: ridge rounded to the compute dtype
P_HIST = 5  #: (W/N)·λ_{b-1} rounded to the compute dtype
P_HAS_HIST = 6  #: 1.0 when the L1 history term is active
P_LAM = 7  #: λ_b rounded to the compute dtype (soft threshold)
P_LAMBDA_VALUE = 8  #: λ_b in float64 (objective)
P_TOL = 9  #: step tolerance
P_RTOL = 10  #: singular-pivot tolerance of the solve ladder
P_MAX_ITER = 11  #: iteration cap
P_FIT_INTERCEPT = 12  #: 1.0 when the last parameter is an intercept
P_PENALISED = 13  #: 1.0 for the L1 (LAMM) solver
N_PARAM = 16

# -- solver state (float64) -----------------------------------------------------
S_PHI = 16  #: LAMM φ at the start of the next trial round
S_LOSS = 17  #: Σ w ρ(r) at the committed β (commit)
S_WSUM = 18  #: Σ w of the batch (build)
S_T = 19  #: accepted Newton step size
S_STEP = 20  #: ‖β_new − β_old‖ of the last accepted step
S_NORM = 21  #: ‖β_new‖ of the last accepted step
S_OBJ = 22  #: objective diagnostic (commit)
S_SLOPE = 23  #: gᵀD of the last Newton iteration
N_DOUBLE = 32

# -- integer state (int32, after the doubles) ------------------------------------
I_DONE = 0  #: the batch's solve has stopped (converged, failed or capped)
I_ITER = 1  #: iterations run on this batch
I_TRIALS = 2  #: LAMM trials already spent in the current iteration
I_CONV = 3  #: converged flag
I_ACCEPT = 4  #: the last iteration accepted a step
I_FALLBACK = 5  #: Cholesky failed the singularity test: the host must solve
I_INFO = 6  #: cuSOLVER potrf devInfo
I_INFO_SOLVE = 7  #: cuSOLVER potrs devInfo
I_INVALID = 8  #: bit 1: non-finite X or y; bit 2: negative or non-finite weight
I_TICKET = 9  #: last-block ticket of the grid reductions (reset by the last block)
I_COMMITTED = 10  #: the batch's result has been committed to β and J
N_INT = 16

CTL_BYTES = N_DOUBLE * 8 + N_INT * 4

#: Newton line search: the contract's t = 1, 1/2, ... down to the last t ≥ MIN_STEP.
LINE_SEARCH_STEPS = math.floor(-math.log2(MIN_STEP)) + 1
#: LAMM curvatures φ, 2φ, ..., 2^(K-1)φ evaluated in one pass over the data.
LAMM_ROUND = 8
#: Threads of the row kernels (warps of 32, one row per warp at a time).
ROW_THREADS = 512
#: Rows a warp keeps in flight at once in the row kernels (loads interleaved).
ROWS = 4
#: Rows per lane in the fused Cholesky kernel: it serves p ≤ 32 × this.
SOLVE_ROWS = 8
#: Threads of the single-block kernels (p-space work).
SMALL_THREADS = 512
#: From this p on, the Newton system's assembly, the products with J and the
#: commit's J update run as grid kernels (``rh_wide_*``) instead of in one
#: block: a single multiprocessor reading p×p matrices is latency-bound, and
#: at p = 2048 those passes cost more than the Gram GEMM. Below it the
#: one-block kernels are unchanged (same launches, same bits).
WIDE_MIN_P = 256
#: Threads of the tile kernels of wide designs (32×32 tiles, 8 rows at a time).
WIDE_THREADS = 256
#: Predicates of the gated wide kernels (``rh_wide_symv``'s ``gate``): always,
#: the solve is open, the commit is due, a LAMM iteration starts.
GATE_ALWAYS = 0
GATE_OPEN = 1
GATE_COMMIT = 2
GATE_LAMM = 3


def cuda_defines() -> str:
    """``#define`` lines for every constant above (prepended to the kernels)."""
    lines = []
    for name, value in sorted(globals().items()):
        if name.isupper() and isinstance(value, int):
            lines.append(f"#define RH_{name} {value}")
    return "\n".join(lines) + "\n"
