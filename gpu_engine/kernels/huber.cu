// Kernels of the rh-dask GPU engine (compiled at run time by NVRTC through
// cupy.RawModule; gpu_engine/kernels.py prepends the RH_* layout constants
// from gpu_engine/layout.py, defines the numerical contract's constants from
// rh_dask/core.py in the compile options (RH_LAMM_SLACK, RH_LAMM_MIN_PHI,
// RH_LAMM_MAX_TRIALS) and instantiates every template for float and double).
//
// Conventions
// * Row kernels give one warp one row at a time (lanes stride the columns,
//   so loads are coalesced) and walk the rows grid-stride; the grid size is a
//   function of the row count and the device only, so every reduction below
//   adds the same numbers in the same order on every run: results are
//   bit-reproducible. No floating-point atomics anywhere; the only atomic is
//   the integer "last block" ticket.
// * Grid reductions: every block writes its partial sums, the block that
//   arrives last (integer ticket) adds the partials in block order and then
//   *finalises* the iteration on the device (line-search decision, β update,
//   convergence test) so that the host reads one small status buffer per
//   iteration instead of driving each decision with its own round trip.
// * Per-element arithmetic follows the NumPy reference operation by
//   operation, in the compute dtype T; scalar reductions accumulate in double.

#if !defined(RH_LAMM_SLACK) || !defined(RH_LAMM_MIN_PHI) || !defined(RH_LAMM_MAX_TRIALS)
#error "the contract's constants come from rh_dask/core.py: compile through gpu_engine/kernels.py"
#endif

#define FULL_MASK 0xffffffffu
#define MAX_WARPS (RH_ROW_THREADS / 32)

namespace {

template <typename T>
__device__ __forceinline__ T clip(T x, T lo, T hi) {
  // numpy.clip(x, lo, hi) == minimum(maximum(x, lo), hi)
  const T m = x < lo ? lo : x;
  return m > hi ? hi : m;
}

template <typename T>
__device__ __forceinline__ T sign_of(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));
}

// Products whose rounding must match NumPy's separate multiply (no FMA
// contraction into a following add).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// |x| and finiteness without relying on NVRTC's overload set.
__device__ __forceinline__ float absv(float x) { return fabsf(x); }
__device__ __forceinline__ double absv(double x) { return fabs(x); }
__device__ __forceinline__ float sqrtv(float x) { return sqrtf(x); }
__device__ __forceinline__ double sqrtv(double x) { return sqrt(x); }
__device__ __forceinline__ bool finite_v(float x) { return fabsf(x) <= 3.402823466e38f; }
__device__ __forceinline__ bool finite_v(double x) { return fabs(x) <= 1.7976931348623157e308; }

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;  // the xor butterfly leaves the same value in every lane
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ int* ctl_ints(double* ctl) {
  return reinterpret_cast<int*>(ctl + RH_N_DOUBLE);
}

// Copy the control block into the host-mapped status buffer (one block).
__device__ void mirror_status(const double* ctl, double* status) {
  __syncthreads();
  const int n = RH_N_DOUBLE + RH_N_INT / 2;
  for (int i = threadIdx.x; i < n; i += blockDim.x) status[i] = ctl[i];
  __threadfence_system();
}

// An accepted step (thread 0, after the iteration count was advanced): its
// size and β's norm for the diagnostics, then the contract's convergence test.
__device__ __forceinline__ void record_step(double* ctl, int* ci, double step, double nn) {
  ctl[RH_S_STEP] = step;
  ctl[RH_S_NORM] = nn;
  const int conv = step <= ctl[RH_P_TOL] * (1.0 + nn) ? 1 : 0;
  ci[RH_I_CONV] = conv;
  if (conv || ci[RH_I_ITER] >= (int)ctl[RH_P_MAX_ITER]) ci[RH_I_DONE] = 1;
}

// No step could be accepted: the solve ends unconverged (thread 0).
__device__ __forceinline__ void record_stall(int* ci) {
  ci[RH_I_ACCEPT] = 0;
  ci[RH_I_CONV] = 0;
  ci[RH_I_DONE] = 1;
}

// The batch failed rh_build's validation (RH_I_INVALID: bit 1 non-finite X
// or y, bit 2 a negative or non-finite weight). The host refuses it, so
// nothing computed from it may reach β, J or the host-mapped β mirror.
__device__ __forceinline__ bool batch_refused(const int* ci) { return ci[RH_I_INVALID] != 0; }

// Whether the iterating kernels still run: the solve has not stopped and
// the batch passed validation. Every iterating kernel tests it, so that
// rounds queued for a refused batch neither step nor stall.
__device__ __forceinline__ bool solve_open(const int* ci) {
  return ci[RH_I_DONE] == 0 && !batch_refused(ci);
}

// Whether the commit kernels write now: the solve has stopped, the batch is
// not committed yet, and it passed validation. This is the only way into
// the writes of β, J and the β mirror, whatever ended the solve (converged,
// capped, stalled) and however the kernels were queued.
__device__ __forceinline__ bool commit_due(const int* ci) {
  return ci[RH_I_DONE] != 0 && ci[RH_I_COMMITTED] == 0 && !batch_refused(ci);
}

// A vector spread over a warp's registers (element i in lane i % 32, register
// i / 32): this lane's register of element k's row (selected with unrolled
// compares, so that v stays in registers rather than local memory).
template <int R, typename T>
__device__ __forceinline__ T column_register(const T (&v)[R], int k) {
  const int mk = k >> 5;
  T mine = T(0);
#pragma unroll
  for (int m = 0; m < R; ++m)
    if (m == mk) mine = v[m];
  return mine;
}

// Last-block election: every block calls it after writing its partials.
__device__ bool arrive_last(unsigned int* ticket) {
  __shared__ unsigned int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = (atomicAdd(ticket, 1u) == gridDim.x - 1) ? 1u : 0u;
  __syncthreads();
  if (s_last) __threadfence();
  return s_last != 0u;
}

// (hi, lo) += (b_hi, b_lo) in double-double: TwoSum of the high parts, then
// FastTwoSum to renormalise (|s| ≥ |t| for the non-negative sums it serves),
// so that hi = fl(hi + lo) afterwards. No products: nothing to contract.
__device__ __forceinline__ void dd_add(double& hi, double& lo, double b_hi, double b_lo) {
  const double s = hi + b_hi;
  const double v = s - hi;
  const double e = (hi - (s - v)) + (b_hi - v);  // s + e = hi + b_hi exactly
  const double t = e + (lo + b_lo);
  hi = s + t;
  lo = t - (hi - s);
}

// One step of lane_grid_reduce's sums: component `lane` += src[lane], except
// that with DD components 2 and 3 are one double-double, added by lane 2.
template <bool DD>
__device__ __forceinline__ void lane_add(double& s, double& c, const double* src, int lane) {
  if (DD && lane == 2) {
    dd_add(s, c, src[2], src[3]);
  } else {
    s += src[lane];
  }
}

// Lane 2's carry goes into component 3's slot (lane 3 leaves it alone).
template <bool DD>
__device__ __forceinline__ void lane_store(double* dst, double s, double c, int lane) {
  if (DD && lane == 3) return;
  dst[lane] = s;
  if (DD && lane == 2) dst[3] = c;
}

// Each thread holds one value of component `lane` (0..31). Blocks reduce in
// warp order, the last block adds the block partials in block order; there it
// returns true and red[MAX_WARPS * 32 + k] holds the grid total of component k.
// With DD, components 2 and 3 are the high and low parts of one non-negative
// double-double sum, reduced as such (the total's correctly rounded value
// ends in component 2). `red` must hold (MAX_WARPS + 1) * 32 doubles.
template <bool DD = false>
__device__ bool lane_grid_reduce(double v, double* partials, unsigned int* ticket,
                                 double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  red[warp * 32 + lane] = v;
  __syncthreads();
  if (warp == 0) {
    double s = 0.0, c = 0.0;
    for (int w = 0; w < nwarps; ++w) lane_add<DD>(s, c, red + w * 32, lane);
    lane_store<DD>(partials + (size_t)blockIdx.x * 32, s, c, lane);
  }
  if (!arrive_last(ticket)) return false;
  double s = 0.0, c = 0.0;
  for (unsigned int b = warp; b < gridDim.x; b += nwarps) {
    const double* src = partials + (size_t)b * 32;
    if (DD && lane == 2) {
      dd_add(s, c, __ldcg(src + 2), __ldcg(src + 3));
    } else {
      s += __ldcg(src + lane);
    }
  }
  lane_store<DD>(red + warp * 32, s, c, lane);
  __syncthreads();
  if (warp == 0) {
    double t = 0.0, tc = 0.0;
    for (int w = 0; w < nwarps; ++w) lane_add<DD>(t, tc, red + w * 32, lane);
    lane_store<DD>(red + MAX_WARPS * 32, t, tc, lane);
  }
  if (threadIdx.x == 0) *ticket = 0u;  // ready for the next kernel
  __syncthreads();
  return true;
}

// Sum K values over one block; every thread gets the totals (same order, same
// bits). `red` must hold MAX_WARPS * K doubles.
template <int K>
__device__ void block_sum(double (&v)[K], double* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) red[warp * K + k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    double s = 0.0;
    for (int w = 0; w < nwarps; ++w) s += red[w * K + k];
    v[k] = s;
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ T row_dot(const T* __restrict__ z, const T* __restrict__ v,
                                     long long p, int lane) {
  T acc = T(0);
#pragma unroll 4
  for (long long j = lane; j < p; j += 32) acc += z[j] * v[j];
  return warp_sum(acc);
}

// y_a = Σ_b J[b·p + a] v(b, k) for a < p and k < K, by the whole block (J is
// symmetric, so reading it by columns keeps the loads coalesced). Slices of b
// are summed in parallel, then the slices in order; `sink(a, k, y)` is called
// once per (a, k) by one thread. `scratch` holds `cap` doubles.
template <int K, typename T, typename V, typename S>
__device__ void block_symv(const T* __restrict__ J, int p, V v, S sink, double* scratch,
                           int cap) {
  int slices = (int)blockDim.x / p;
  if (slices * K * p > cap) slices = cap / (K * p);
  slices = slices < 1 ? 1 : (slices > 32 ? 32 : slices);
  const int t = threadIdx.x;
  if (slices == 1) {
    for (int a = t; a < p; a += blockDim.x) {
      double acc[K];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = 0.0;
#pragma unroll 8
      for (int b = 0; b < p; ++b) {
        const double jab = (double)J[b * p + a];
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] += jab * v(b, k);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) sink(a, k, acc[k]);
    }
    __syncthreads();
    return;
  }
  if (t < slices * p) {
    const int sl = t / p, a = t % p;
    double acc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = 0.0;
#pragma unroll 4
    for (int b = sl; b < p; b += slices) {
      const double jab = (double)J[b * p + a];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += jab * v(b, k);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) scratch[k * slices * p + t] = acc[k];
  }
  __syncthreads();
  for (int a = t; a < p; a += blockDim.x) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      double s = 0.0;
      for (int sl = 0; sl < slices; ++sl) s += scratch[k * slices * p + sl * p + a];
      sink(a, k, s);
    }
  }
  __syncthreads();
}

// Dot products of R rows (i0, i0 + stride, ...) with v, loads interleaved so
// that a warp keeps R rows of loads in flight. Each row is summed in the same
// order as a one-row dot, so results do not depend on R.
template <int R, typename T>
__device__ __forceinline__ void rows_dot(const T* __restrict__ Z, long long ldz, long long i0,
                                         long long stride, long long n,
                                         const T* __restrict__ v, long long p, int lane,
                                         T (&out)[R]) {
  T acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = T(0);
  for (long long j = lane; j < p; j += 32) {
    const T vj = v[j];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const long long i = i0 + r * stride;
      if (i < n) acc[r] += Z[i * ldz + j] * vj;
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) out[r] = warp_sum(acc[r]);
}


// ---- wide designs (p ≥ RH_WIDE_MIN_P): p-space work spread over the grid ----
// One block per strip of 32 columns a: y_{k,a} = Σ_b J[b·p + a] v(b, k) in
// double, warp w adding the rows b ≡ w (mod warps) and warp 0 the warps'
// sums in warp order: a fixed order, so fixed bits, with the whole device
// reading J instead of one multiprocessor. Writes out[k·p + a].
template <int K, typename T, typename V>
__device__ void wide_symv(const T* __restrict__ J, int p, V v, double* __restrict__ out) {
  __shared__ double part[K * MAX_WARPS * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int a = blockIdx.x * 32 + lane;
  double acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.0;
  if (a < p) {
#pragma unroll 8
    for (int b = warp; b < p; b += nwarps) {
      const double jab = (double)J[(size_t)b * p + a];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += jab * v(b, k);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) part[(k * nwarps + warp) * 32 + lane] = acc[k];
  __syncthreads();
  if (warp == 0 && a < p) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      double s = 0.0;
      for (int w = 0; w < nwarps; ++w) s += part[(k * nwarps + w) * 32 + lane];
      out[(size_t)k * p + a] = s;
    }
  }
}

// One 32×32 tile per block (tile index blockIdx.x, tiles of a fastest) of
// sym(C)[a, b] = C[max(a, b) + min(a, b)·q], the lower triangle of the
// column-major q×q C: `sink(a, b, c)` for every (a, b) of the tile inside q.
// The upper triangle's entries are read through a shared-memory transpose,
// so that every global load is coalesced.
template <typename T, typename S>
__device__ void sym_tile(const T* __restrict__ C, int q, S sink) {
  __shared__ T tr[32][33];
  const int tiles = (q + 31) / 32;
  const int ta = blockIdx.x % tiles, tb = blockIdx.x / tiles;
  const int x = threadIdx.x & 31, y0 = threadIdx.x >> 5, ny = blockDim.x >> 5;
  if (ta <= tb) {  // the tile has entries with a < b: stage C[b + a·q] as tr[a][b]
    for (int r = y0; r < 32; r += ny) {
      const int b = tb * 32 + x, a = ta * 32 + r;
      tr[r][x] = (a < q && b < q) ? C[(size_t)b + (size_t)a * q] : T(0);
    }
  }
  __syncthreads();
  for (int r = y0; r < 32; r += ny) {
    const int a = ta * 32 + x, b = tb * 32 + r;
    if (a < q && b < q) sink(a, b, a >= b ? C[(size_t)a + (size_t)b * q] : tr[x][r]);
  }
}

// Whether a gated p-space kernel runs (layout.py's GATE_ values: the predicate of the
// kernel whose input it prepares).
__device__ __forceinline__ bool gate_open(const int* ci, long long gate) {
  if (gate == RH_GATE_OPEN) return solve_open(ci);
  if (gate == RH_GATE_COMMIT) return commit_due(ci);
  if (gate == RH_GATE_LAMM) return solve_open(ci) && ci[RH_I_TRIALS] == 0;
  return true;
}

__device__ __forceinline__ double mask_of(long long a, long long p, const double* ctl) {
  return (ctl[RH_P_FIT_INTERCEPT] != 0.0 && a == p - 1) ? 0.0 : 1.0;
}

// The LAMM round's steps e_k = S(β − g/φ_k, λm/φ_k) − β, φ_k = 2^k φ, into E
// ([RH_LAMM_ROUND][ldp], shared memory), by the whole block; ends with a barrier.
// rh_lamm_trials and rh_wide_lamm_symv form them with this same code.
template <typename T>
__device__ __forceinline__ void lamm_steps(T* E, long long p, long long ldp,
                                           const T* __restrict__ beta,
                                           const T* __restrict__ g,
                                           const double* __restrict__ ctl) {
  const double phi0 = ctl[RH_S_PHI];
  const T lam = (T)ctl[RH_P_LAM];
  for (int k = 0; k < RH_LAMM_ROUND; ++k)
  for (int j = threadIdx.x; j < (int)p; j += blockDim.x) {
    const T ip = (T)(1.0 / (phi0 * ldexp(1.0, k)));
    const T bj = beta[j];
    const T x = bj - mul_rn(g[j], ip);
    const T thr = mul_rn((T)mask_of(j, p, ctl) * lam, ip);
    const T mag = absv(x) - thr;
    const T c = sign_of(x) * (mag > T(0) ? mag : T(0));
    E[(size_t)k * ldp + j] = c - bj;
  }
  __syncthreads();
}

// The Newton system at β (one block of RH_SMALL_THREADS threads):
// H = (sym(C) + J)/N + ridge·I into H1 (leading dimension ld1) and H2 (q), and
// g = (JΔ − Zᵀwψ)/N − hist·s into g1 and g2 (Δ = β − β0, s = sign(β0)).
template <typename T>
__device__ __forceinline__ void assemble_system(int q, const T* __restrict__ C,
                                                const T* __restrict__ J,
                                                const T* __restrict__ beta,
                                                const T* __restrict__ beta0,
                                                const double* __restrict__ ctl, T* H1, T* H2,
                                                T* __restrict__ g1, T* g2, int ld1) {
  const T inv = (T)ctl[RH_P_INV_TOTAL], ridge = (T)ctl[RH_P_RIDGE], hist = (T)ctl[RH_P_HIST];
  const bool has_hist = ctl[RH_P_HAS_HIST] != 0.0;
  const int qq = q * q;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int b = warp; b < q; b += nwarps) {
    for (int a = lane; a < q; a += 32) {
      const int idx = a + b * q;
      const int hi = a > b ? a : b, lo = a > b ? b : a;
      // GEMM rounds C[a,b] and C[b,a] differently: take the lower triangle so
      // that H is exactly symmetric, like the reference's SYRK.
      T h = C[hi + lo * q] + J[idx];
      h = h * inv;
      if (a == b) h = h + ridge;
      H1[a + b * ld1] = h;
      H2[idx] = h;
    }
  }
  __shared__ double scratch[RH_SMALL_THREADS];
  block_symv<1>(
      J, q, [&](int b, int) { return (double)(beta[b] - beta0[b]); },
      [&](int a, int, double jd) {
        T ga = (T)jd - C[a + qq];
        ga = ga * inv;
        if (has_hist) ga = ga - mul_rn(hist, (T)(sign_of(beta0[a]) * (T)mask_of(a, q, ctl)));
        g1[a] = ga;
        g2[a] = ga;
      },
      scratch, RH_SMALL_THREADS);
}

}  // namespace

// ---------------------------------------------------------------------------
// Design matrix: Z = [X, 1, 0-padding] (row stride ldz), y and w copied into
// the workspace, and the batch validated in the same pass (non-finite X/y,
// negative or non-finite weights, Σw).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_build(const T* __restrict__ X, long long ldx, const T* __restrict__ y,
         const T* __restrict__ w, long long n, long long d, long long p, long long ldz,
         T* __restrict__ Z, T* __restrict__ yz, T* __restrict__ wz,
         double* __restrict__ partials, double* __restrict__ ctl, double* status,
         const T* __restrict__ beta, T* __restrict__ beta_work) {
  __shared__ double red[(MAX_WARPS + 1) * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The solve starts from the stream's β, copied here rather than by a
  // cudaMemcpyAsync: one runtime call fewer on the engine's thread per batch
  // (H200, 65,536-row chunks in the distributed fit: 7 % less wall time).
  if (blockIdx.x == 0) {
    for (long long j = threadIdx.x; j < p; j += blockDim.x) beta_work[j] = beta[j];
  }
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  // Σw is a counter every engine must give to the last bit: a double-double
  // sum, correctly rounded like the reference's (rh_dask.core.sum_weights)
  // except within about 2^-100 of a rounding tie, and exact for dyadic weights.
  double bad_x = 0.0, bad_w = 0.0, wsum = 0.0, wsum_lo = 0.0;
  for (long long i = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i < n; i += nw) {
    const T* xr = X + i * ldx;
    T* zr = Z + i * ldz;
    for (long long j = lane; j < ldz; j += 32) {
      T v;
      if (j < d) {
        v = xr[j];
        if (!finite_v(v)) bad_x = 1.0;
      } else {
        v = (j < p) ? T(1) : T(0);
      }
      zr[j] = v;
    }
    if (lane == 0) {
      const T yi = y[i];
      if (!finite_v(yi)) bad_x = 1.0;
      yz[i] = yi;
      const T wi = (w != nullptr) ? w[i] : T(1);
      if (!(finite_v(wi) && wi >= T(0))) bad_w = 1.0;
      wz[i] = wi;
      dd_add(wsum, wsum_lo, (double)wi, 0.0);
    }
  }
  bad_x = warp_sum(bad_x);
  bad_w = warp_sum(bad_w);
  // Only lane 0 summed weights: its pair reaches lanes 2 and 3 unchanged.
  wsum = __shfl_sync(FULL_MASK, wsum, 0);
  wsum_lo = __shfl_sync(FULL_MASK, wsum_lo, 0);
  const double mine = lane == 0   ? bad_x
                      : lane == 1 ? bad_w
                      : lane == 2 ? wsum
                      : lane == 3 ? wsum_lo
                                  : 0.0;
  int* ci = ctl_ints(ctl);
  if (!lane_grid_reduce<true>(mine, partials,
                              reinterpret_cast<unsigned int*>(ci + RH_I_TICKET), red))
    return;
  if (threadIdx.x == 0) {
    int flags = ci[RH_I_INVALID];
    if (red[MAX_WARPS * 32 + 0] > 0.0) flags |= 1;
    if (red[MAX_WARPS * 32 + 1] > 0.0) flags |= 2;
    ci[RH_I_INVALID] = flags;
    // A refused batch stops here: the iterating kernels and the commit
    // kernels test the flag (solve_open, commit_due) and return at once.
    if (flags != 0) ci[RH_I_DONE] = 1;
    ctl[RH_S_WSUM] = red[MAX_WARPS * 32 + 2];
  }
  mirror_status(ctl, status);
}

// ---------------------------------------------------------------------------
// The fused row pass of an evaluation at β, shared by Newton's step 1 and the
// commit: r = y − Zβ, ψ = clip(r, ±τ), κ = clip((τ − |r|)/(2h) + ½, 0, 1) and
// M's rows w κ ⊙ z; Newton also keeps w ψ (M's last column) and r. Σ w ρ(r)
// is reduced over the grid into ctl[RH_S_LOSS]; returns true in the one block
// that wrote it (the last to arrive).
// ---------------------------------------------------------------------------
template <bool NEWTON, typename T>
__device__ bool eval_rows(const T* __restrict__ Z, long long ldz, long long n, long long p,
                          const T* __restrict__ y, const T* __restrict__ w,
                          const T* __restrict__ beta, double* __restrict__ ctl,
                          T* __restrict__ r, T* __restrict__ M, long long ldm,
                          double* __restrict__ partials) {
  extern __shared__ double smem_d[];
  __shared__ double red[(MAX_WARPS + 1) * 32];
  T* sb = reinterpret_cast<T*>(smem_d);
  for (long long j = threadIdx.x; j < p; j += blockDim.x) sb[j] = beta[j];
  __syncthreads();
  const T tau = (T)ctl[RH_P_TAU], hih = (T)ctl[RH_P_HALF_INV_H];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  double loss = 0.0;
  for (long long i0 = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i0 < n; i0 += RH_ROWS * nw) {
    T dots[RH_ROWS];
    rows_dot<RH_ROWS>(Z, ldz, i0, nw, n, sb, p, lane, dots);
#pragma unroll
    for (int rr = 0; rr < RH_ROWS; ++rr) {
      const long long i = i0 + rr * nw;
      if (i >= n) break;
      const T* zr = Z + i * ldz;
      const T ri = y[i] - dots[rr];
      const T psi = clip(ri, -tau, tau);
      T k = tau - absv(ri);
      k = mul_rn(k, hih) + T(0.5);
      k = clip(k, T(0), T(1));
      const T wi = w[i];
      const T c = k * wi;
      T* mr = M + i * ldm;
      for (long long j = lane; j < p; j += 32) mr[j] = c * zr[j];
      if (lane == 0) {
        if (NEWTON) {
          mr[p] = wi * psi;
          r[i] = ri;
        }
        const T rho = (ri - psi * T(0.5)) * psi;
        loss += (double)(wi * rho);
      }
    }
  }
  int* ci = ctl_ints(ctl);
  if (!lane_grid_reduce(lane == 0 ? loss : 0.0, partials,
                        reinterpret_cast<unsigned int*>(ci + RH_I_TICKET), red))
    return false;
  if (threadIdx.x == 0) ctl[RH_S_LOSS] = red[MAX_WARPS * 32];
  return true;
}

// ---------------------------------------------------------------------------
// Newton, step 1: r = y − Zβ, ψ, κ and the right factor of the fused Gram +
// gradient product, M = [w κ(r) ⊙ Z | w ψ(r)] (row stride ldm). Σ w ρ(r) is
// the objective diagnostic if this iterate is the batch's last.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_newton_eval(const T* __restrict__ Z, long long ldz, long long n, long long p,
               const T* __restrict__ y, const T* __restrict__ w,
               const T* __restrict__ beta, double* __restrict__ ctl,
               T* __restrict__ r, T* __restrict__ M, long long ldm,
               double* __restrict__ partials) {
  eval_rows<true>(Z, ldz, n, p, y, w, beta, ctl, r, M, ldm, partials);
}

// ---------------------------------------------------------------------------
// Newton, step 2 (one block): from C = Zᵀ[M] (p × (p+1), column-major) build
// H = (sym(C) + J)/N + ridge·I (twice: one copy is factorised in place) and
// g = (JΔ − Zᵀwψ)/N − hist·s; D starts as g (potrs solves in place).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_assemble(const T* __restrict__ C, const T* __restrict__ J,
                   const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                   const double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                   T* __restrict__ g, T* __restrict__ D) {
  assemble_system((int)p, C, J, beta, beta0, ctl, H, Hs, g, D, (int)p);
}

// ---------------------------------------------------------------------------
// Wide designs (p ≥ RH_WIDE_MIN_P), the p-space steps as grid kernels: a
// single block reading a p×p matrix is latency-bound (at p = 2048, several
// milliseconds per pass, more than the Gram GEMM).
//
// rh_wide_symv: out = J v (double), v = x − x0 (x0 null: v = x), by strips
// of 32 columns per block; a no-op unless `gate` (a GATE_ value of layout.py) holds, so that
// a graph queues it unconditionally before the kernel that reads `out`.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_wide_symv(const T* __restrict__ J, long long p, const T* __restrict__ x,
             const T* __restrict__ x0, double* __restrict__ ctl, long long gate,
             double* __restrict__ out) {
  if (!gate_open(ctl_ints(ctl), gate)) return;
  if (x0 != nullptr) {
    wide_symv<1>(J, (int)p, [&](int b, int) { return (double)(x[b] - x0[b]); }, out);
  } else {
    wide_symv<1>(J, (int)p, [&](int b, int) { return (double)x[b]; }, out);
  }
}

// rh_newton_assemble over the grid: tiles of H = (sym(C) + J)/N + ridge·I
// (into H and Hs), then ceil(p / blockDim) blocks forming g (and D = g) from
// jv = J(β − β0) of rh_wide_symv. Grid: tiles² + ceil(p / blockDim) blocks.
template <typename T>
__global__ void __launch_bounds__(RH_WIDE_THREADS)
rh_wide_assemble(const T* __restrict__ C, const T* __restrict__ J,
                 const T* __restrict__ beta0, long long p, const double* __restrict__ ctl,
                 const double* __restrict__ jv, T* __restrict__ H, T* __restrict__ Hs,
                 T* __restrict__ g, T* __restrict__ D) {
  const int q = (int)p, tiles = (q + 31) / 32;
  const T inv = (T)ctl[RH_P_INV_TOTAL];
  if ((int)blockIdx.x >= tiles * tiles) {  // the gradient
    const int a = ((int)blockIdx.x - tiles * tiles) * (int)blockDim.x + (int)threadIdx.x;
    if (a < q) {
      const T hist = (T)ctl[RH_P_HIST];
      T ga = (T)jv[a] - C[(size_t)a + (size_t)q * q];
      ga = ga * inv;
      if (ctl[RH_P_HAS_HIST] != 0.0)
        ga = ga - mul_rn(hist, (T)(sign_of(beta0[a]) * (T)mask_of(a, q, ctl)));
      g[a] = ga;
      D[a] = ga;
    }
    return;
  }
  const T ridge = (T)ctl[RH_P_RIDGE];
  sym_tile(C, q, [&](int a, int b, T c) {
    const size_t idx = (size_t)a + (size_t)b * q;
    T h = c + J[idx];
    h = h * inv;
    if (a == b) h = h + ridge;
    H[idx] = h;
    Hs[idx] = h;
  });
}

// rh_commit_finish's J ← J + sym(C) over the grid (tiles² blocks), when the
// commit is due; queued before rh_commit_finish, which then skips it.
template <typename T>
__global__ void __launch_bounds__(RH_WIDE_THREADS)
rh_wide_commit_gram(const T* __restrict__ C, T* __restrict__ J, long long p,
                    double* __restrict__ ctl) {
  if (!commit_due(ctl_ints(ctl))) return;
  sym_tile(C, (int)p, [&](int a, int b, T c) {
    const size_t idx = (size_t)a + (size_t)b * p;
    J[idx] = J[idx] + c;
  });
}

// rh_lamm_trials' products J e_k for wide designs: the round's K steps formed
// in shared memory by lamm_steps (the trials kernel's own code, so the same
// bits), then out[k·p + a] = (J e_k)_a by strips of 32 columns per block.
// A no-op unless the solve is open. Dynamic shared memory: K·ldp values of T.
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_wide_lamm_symv(const T* __restrict__ J, long long p, long long ldp,
                  const T* __restrict__ beta, const T* __restrict__ g,
                  double* __restrict__ ctl, double* __restrict__ out) {
  if (!solve_open(ctl_ints(ctl))) return;
  extern __shared__ double smem_d[];
  T* E = reinterpret_cast<T*>(smem_d);
  lamm_steps(E, p, ldp, beta, g, ctl);
  wide_symv<RH_LAMM_ROUND>(
      J, (int)p, [&](int b, int k) { return (double)E[(size_t)k * ldp + b]; }, out);
}

// ---------------------------------------------------------------------------
// The outputs of the one-block Newton solves, after a block barrier: A (q×q,
// leading dimension ld: L in its lower triangle) to H (leading dimension q),
// vec (the solution, or g if the factorisation failed) to D, and the
// factor's potrf-style status to ctl.
template <typename T>
__device__ __forceinline__ void publish_solve(int q, int ld, const T* A, const T* vec, int fail,
                                              double* __restrict__ ctl, T* __restrict__ H,
                                              T* __restrict__ D) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int b = warp; b < q; b += nwarps)
    for (int a = lane; a < q; a += 32) H[a + b * q] = A[a + b * ld];
  for (int a = threadIdx.x; a < q; a += blockDim.x) D[a] = vec[a];
  if (threadIdx.x == 0) {
    int* ci = ctl_ints(ctl);
    ci[RH_I_INFO] = fail;
    ci[RH_I_INFO_SOLVE] = 0;
  }
}

// The end of the one-block Newton solves, once A holds L (column-major, its
// diagonal also in lcol) and vec the right-hand side: unless the factorisation
// failed, L y = g (FORWARD; otherwise vec already holds y) and then Lᵀ x = y
// by one warp with the right-hand side in registers; then L goes to H, the
// solution to D and the factor's status to ctl.
// ---------------------------------------------------------------------------
template <bool FORWARD, typename T>
__device__ __forceinline__ void solve_factored(int q, const T* A, T* vec, const T* lcol,
                                               int fail, int lane, int warp,
                                               double* __restrict__ ctl, T* __restrict__ H,
                                               T* __restrict__ D) {
  if (warp == 0 && fail == 0) {
    // L y = g, then Lᵀ x = y, one warp, the right-hand side in registers
    T vr[RH_SOLVE_ROWS];
#pragma unroll
    for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
      const int i = lane + 32 * m;
      vr[m] = i < q ? vec[i] : T(0);
    }
    // Selects, not per-row branches: the rows that count get the same
    // arithmetic; a load whose row does not count reads a valid address.
    for (int k = 0; FORWARD && k < q; ++k) {
      const T yk = __shfl_sync(FULL_MASK, column_register(vr, k) / lcol[k], k & 31);
#pragma unroll
      for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
        if (32 * m >= q || 32 * m + 31 < k) continue;  // warp-uniform
        const int i = lane + 32 * m;
        const bool below = i > k && i < q;
        const T aik = A[(below ? i : k) + k * q];
        vr[m] = below ? vr[m] - aik * yk : (i == k ? yk : vr[m]);
      }
    }
    for (int k = q - 1; k >= 0; --k) {
      const T xk = __shfl_sync(FULL_MASK, column_register(vr, k) / lcol[k], k & 31);
#pragma unroll
      for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
        if (32 * m > k) continue;  // warp-uniform: no row ≤ k here
        const int i = lane + 32 * m;
        const bool above = i < k;
        const T aki = A[k + (above ? i : k) * q];
        vr[m] = above ? vr[m] - aki * xk : (i == k ? xk : vr[m]);
      }
    }
#pragma unroll
    for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
      const int i = lane + 32 * m;
      if (i < q) vec[i] = vr[m];
    }
  }
  __syncthreads();
  publish_solve(q, q, A, vec, fail, ctl, H, D);
}

// ---------------------------------------------------------------------------
// Newton, step 2 for small systems (one block, everything in shared memory):
// the assembly of rh_newton_assemble, the Cholesky factorisation H = L Lᵀ
// (right-looking, two barriers per column) and the two triangular solves
// (one warp, no block barriers). Replaces assemble + cuSOLVER potrf/potrs,
// whose launch chain costs several times more than the arithmetic at these
// sizes. Writes the same outputs: L (lower, column-major) in H, the
// assembled matrix in Hs, g, D and the potrf-style info (k+1 for the first
// non-positive pivot), so that rh_newton_search applies the same tests.
// Dynamic shared memory: (p·p + 2p) values of T.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve(const T* __restrict__ C, const T* __restrict__ J,
                const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                T* __restrict__ g, T* __restrict__ D) {
  extern __shared__ double smem_d[];
  T* A = reinterpret_cast<T*>(smem_d);  // p×p, column-major
  T* vec = A + p * p;                   // right-hand side, then solution
  T* lcol = vec + p;                    // the diagonal of L
  __shared__ int s_fail;
  // 32-bit indices: p-space loops must not pay for 64-bit division.
  const int q = (int)p;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  assemble_system(q, C, J, beta, beta0, ctl, A, Hs, g, vec, q);
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  // Right-looking Cholesky with lane-owned rows: lane l of every warp owns
  // rows l, l + 32, ... (in registers), warp w updates columns j ≡ w. Column
  // k is left unscaled until the end (L[i][k] = A[i][k] / diag[k], the same
  // division LAPACK makes), so one barrier per column suffices.
  for (int k = 0; k < q; ++k) {
    const T d = A[k + k * q];
    if (!(d > T(0))) {  // every thread reads the same pivot: a uniform exit
      if (threadIdx.x == 0) s_fail = k + 1;
      break;
    }
    const T lkk = sqrtv(d);
    T lr[RH_SOLVE_ROWS];
#pragma unroll
    for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
      const int i = lane + 32 * m;
      lr[m] = (i > k && i < q) ? A[i + k * q] / lkk : T(0);
    }
    for (int j = k + 1 + warp; j < q; j += nwarps) {
      const T ljk = A[j + k * q] / lkk;
      T* col = A + j * q;
#pragma unroll
      for (int m = 0; m < RH_SOLVE_ROWS; ++m) {
        const int i = lane + 32 * m;
        if (i >= j && i < q) col[i] -= lr[m] * ljk;
      }
    }
    if (threadIdx.x == 0) lcol[k] = lkk;
    __syncthreads();
  }
  __syncthreads();
  const int fail = s_fail;
  if (fail == 0) {
    for (int b = warp; b < q; b += nwarps) {  // scale the columns: A becomes L
      const T lbb = lcol[b];
      for (int a = b + 1 + lane; a < q; a += 32) A[a + b * q] /= lbb;
      if (lane == 0) A[b + b * q] = lbb;
    }
  }
  __syncthreads();
  solve_factored<true>(q, A, vec, lcol, fail, lane, warp, ctl, H, D);
}

// ---------------------------------------------------------------------------
// Newton, step 2 for mid-size systems (one block, everything in shared
// memory): the assembly of rh_newton_assemble, then a blocked right-looking
// Cholesky in panels of 32 columns, which needs three block barriers per
// panel instead of one per column: warp 0 factors the panel's diagonal tile
// (lane l owns row l of the tile, warp barriers only), every thread solves
// one row of the panel below it against the tile, and the block updates the
// trailing lower triangle. L_ij = a_ij / L_jj as LAPACK's division. The two
// triangular solves are rh_newton_solve's (one warp, right-hand side in
// registers). Same outputs as rh_newton_solve: L (lower, column-major) in
// H, the assembled matrix in Hs, g, D and the potrf-style info.
// Dynamic shared memory: (p·p + 2p) values of T; p ≤ 32·RH_SOLVE_ROWS.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve_blocked(const T* __restrict__ C, const T* __restrict__ J,
                        const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                        double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                        T* __restrict__ g, T* __restrict__ D) {
  extern __shared__ double smem_d[];
  T* A = reinterpret_cast<T*>(smem_d);  // p×p, column-major
  T* vec = A + p * p;                   // right-hand side, then solution
  T* lcol = vec + p;                    // the diagonal of L
  __shared__ int s_fail;
  const int q = (int)p;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  assemble_system(q, C, J, beta, beta0, ctl, A, Hs, g, vec, q);
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  for (int k0 = 0; k0 < q; k0 += 32) {
    const int kw = q - k0 < 32 ? q - k0 : 32;
    if (warp == 0) {
      // the diagonal tile, unblocked: column j scaled, then the tile's
      // trailing rows updated, row l by lane l
      int fail = 0;
      for (int j = 0; j < kw; ++j) {
        const int cj = k0 + j;
        const T d = A[cj + cj * q];  // every lane reads the same pivot: a uniform exit
        if (!(d > T(0))) {
          fail = cj + 1;
          break;
        }
        const T ljj = sqrtv(d);
        __syncwarp();
        if (lane > j && lane < kw) A[k0 + lane + cj * q] = A[k0 + lane + cj * q] / ljj;
        __syncwarp();
        if (lane == j) {
          A[cj + cj * q] = ljj;
          lcol[cj] = ljj;
        }
        if (lane > j && lane < kw) {
          const int row = k0 + lane;
          const T lrj = A[row + cj * q];
          for (int c = j + 1; c <= lane; ++c)
            A[row + (k0 + c) * q] = A[row + (k0 + c) * q] - lrj * A[k0 + c + cj * q];
        }
        __syncwarp();
      }
      if (lane == 0 && fail != 0) s_fail = fail;
    }
    __syncthreads();
    if (s_fail != 0) break;  // uniform: read after the barrier
    // the panel below the tile: L_ij = (a_ij − Σ_{c<j} L_ic L_jc) / L_jj, one row per thread
    for (int i = k0 + kw + (int)threadIdx.x; i < q; i += blockDim.x) {
      for (int j = 0; j < kw; ++j) {
        const int cj = k0 + j;
        T s = A[i + cj * q];
        for (int c = 0; c < j; ++c) s = s - A[i + (k0 + c) * q] * A[cj + (k0 + c) * q];
        A[i + cj * q] = s / lcol[cj];
      }
    }
    __syncthreads();
    // the trailing lower triangle: a_ic −= Σ_j L_ij L_cj over the panel's columns
    for (int c = k0 + kw + warp; c < q; c += nwarps) {
      for (int i = c + lane; i < q; i += 32) {
        T s = A[i + c * q];
        for (int j = 0; j < kw; ++j) s = s - A[i + (k0 + j) * q] * A[c + (k0 + j) * q];
        A[i + c * q] = s;
      }
    }
    __syncthreads();
  }
  const int fail = s_fail;
  solve_factored<true>(q, A, vec, lcol, fail, lane, warp, ctl, H, D);
}

// ---------------------------------------------------------------------------
// Newton, step 2 with the factor's columns in registers (one block of
// RH_SMALL_THREADS threads, p ≤ 128: see the wrappers below): the assembly of
// rh_newton_assemble, then a right-looking Cholesky in which warp w owns the
// columns j ≡ w (mod warps) in registers, lane l the rows l, l + 32, ... of
// each, and the right-hand side rides along as row p, so that the
// factorisation also makes the forward solution y = L⁻¹g (row p of column k
// becomes y_k). Per column k one block barrier: the warp owning column k + 1
// first applies column k's update to it, factors it (pivot, square root, the
// division of L_ik = a_ik / L_kk that LAPACK makes) and publishes it, with
// its pivot's verdict, in the other half of a double buffer, and then every
// warp applies column k to its remaining columns. Then Lᵀ x = y by one warp, as rh_newton_solve. Same
// outputs as rh_newton_solve: L (lower, column-major; the upper triangle the
// assembled H) in H, the assembled matrix in Hs, g, D and the potrf-style
// info (k + 1 for the first non-positive pivot; then D = g).
// Dynamic shared memory: (p·p + 4p + 2) values of T.
// ---------------------------------------------------------------------------

// Column k's update of a column j > k: a_ij −= L_ik L_jk (li: this lane's rows
// of column k, zero outside k < i ≤ q; ljk = L_jk). Branch-free: the rows
// k < i < j of column j take the update too, and are never read (they are
// above the diagonal); a per-row branch cost more than the arithmetic.
template <int R, typename T>
__device__ __forceinline__ void column_update(T (&v)[R], int j, int q, const T (&li)[R], T ljk) {
#pragma unroll
  for (int m = 0; m < R; ++m) {
    if (32 * m + 31 < j || 32 * m > q) continue;  // warp-uniform: no row of this register
    v[m] = v[m] - li[m] * ljk;
  }
}

// Factor column k (its updates done): L_kk = √a_kk, L_ik = a_ik · (1 / L_kk)
// for i > k (row q: y_k; the reciprocal's product, as LAPACK's unblocked
// potf2 scales), kept in v and published in Lk and lcol. Rows above the
// diagonal are scaled too, branch-free, and never read. Returns the
// potrf-style info: 0, or k + 1 for a non-positive pivot (warp-uniform).
template <int R, typename T>
__device__ __forceinline__ int column_factor(T (&v)[R], int k, int q, T* Lk, T* lcol,
                                             int lane) {
  const T d = __shfl_sync(FULL_MASK, column_register(v, k), k & 31);
  if (!(d > T(0))) return k + 1;
  const T lkk = sqrtv(d);
  const T inv = T(1) / lkk;
#pragma unroll
  for (int m = 0; m < R; ++m) {
    if (32 * m + 31 < k || 32 * m > q) continue;
    const int i = lane + 32 * m;
    const T scaled = v[m] * inv;
    v[m] = i == k ? lkk : scaled;
    if (i > k && i <= q) Lk[i] = scaled;
  }
  if (lane == 0) lcol[k] = lkk;
  return 0;
}

template <int R, int CPW, typename T>
__device__ __forceinline__ void newton_solve_columns(const T* __restrict__ C,
                                                     const T* __restrict__ J,
                                                     const T* __restrict__ beta,
                                                     const T* __restrict__ beta0, long long p,
                                                     double* __restrict__ ctl,
                                                     T* __restrict__ H, T* __restrict__ Hs,
                                                     T* __restrict__ g, T* __restrict__ D) {
  constexpr int NW = RH_SMALL_THREADS / 32;
  extern __shared__ double smem_d[];
  T* A = reinterpret_cast<T*>(smem_d);  // p×p, column-major
  T* vec = A + p * p;                   // right-hand side, then y, then the solution
  T* lcol = vec + p;                    // the diagonal of L
  T* Lbuf = lcol + p;                   // two columns of L, rows 0..p (row p: y)
  // the potrf-style info of the column in Lbuf's same half: a warp still
  // reading one half's verdict must not see the next column's
  __shared__ int s_fail[2];
  const int q = (int)p;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  assemble_system(q, C, J, beta, beta0, ctl, A, Hs, g, vec, q);
  // this warp's columns j = warp + NW·c, rows 0..q (row q: g)
  T a[CPW][R];
#pragma unroll
  for (int c = 0; c < CPW; ++c) {
    const int j = warp + NW * c;
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
      a[c][m] = (j < q && i >= j && i <= q) ? (i < q ? A[i + j * q] : vec[j]) : T(0);
    }
  }
  if (warp == 0) {
    const int f = column_factor(a[0], 0, q, Lbuf, lcol, lane);
    if (lane == 0) s_fail[0] = f;
  }
  int fail = 0;
  __syncthreads();
  for (int k = 0; k < q; ++k) {
    fail = s_fail[k & 1];  // written before the last barrier: the same for every thread
    if (fail != 0) break;
    const T* Lk = Lbuf + (k & 1) * (q + 1);
    T* Lnext = Lbuf + ((k + 1) & 1) * (q + 1);
    const int kn = k + 1;
    T li[R];  // this lane's rows of column k, read once for all of the warp's columns
#pragma unroll
    for (int m = 0; m < R; ++m) {
      const int i = lane + 32 * m;
      li[m] = (i > k && i <= q) ? Lk[i] : T(0);
    }
    if (kn < q && warp == kn % NW) {  // the next column first: it is on the critical path
      const int cn = kn / NW;
#pragma unroll
      for (int c = 0; c < CPW; ++c) {
        if (c == cn) {
          column_update(a[c], kn, q, li, Lk[kn]);
          const int f = column_factor(a[c], kn, q, Lnext, lcol, lane);
          if (lane == 0) s_fail[kn & 1] = f;
        }
      }
    }
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const int j = warp + NW * c;
      if (j > kn && j < q) column_update(a[c], j, q, li, Lk[j]);
    }
    __syncthreads();
  }
  if (fail == 0) {  // L into A's lower triangle, y into vec
#pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const int j = warp + NW * c;
      if (j >= q) continue;
#pragma unroll
      for (int m = 0; m < R; ++m) {
        const int i = lane + 32 * m;
        if (i >= j && i < q) A[i + j * q] = a[c][m];
        if (i == q) vec[j] = a[c][m];
      }
    }
  }
  __syncthreads();
  solve_factored<false>(q, A, vec, lcol, fail, lane, warp, ctl, H, D);
}

// The instantiations by size: p ≤ 32, ≤ 96 and ≤ 128 (rows 0..p need
// 32·R > p, columns NW·CPW ≥ p).
template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve_columns_s(const T* __restrict__ C, const T* __restrict__ J,
                          const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                          double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                          T* __restrict__ g, T* __restrict__ D) {
  newton_solve_columns<2, 32 / (RH_SMALL_THREADS / 32)>(C, J, beta, beta0, p, ctl, H, Hs, g, D);
}

template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve_columns_m(const T* __restrict__ C, const T* __restrict__ J,
                          const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                          double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                          T* __restrict__ g, T* __restrict__ D) {
  newton_solve_columns<4, 96 / (RH_SMALL_THREADS / 32)>(C, J, beta, beta0, p, ctl, H, Hs, g, D);
}

template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve_columns_l(const T* __restrict__ C, const T* __restrict__ J,
                          const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                          double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                          T* __restrict__ g, T* __restrict__ D) {
  newton_solve_columns<5, 128 / (RH_SMALL_THREADS / 32)>(C, J, beta, beta0, p, ctl, H, Hs, g, D);
}

// ---------------------------------------------------------------------------
// Newton, step 2 in tiles of 32 columns whose serial steps run in one warp's
// registers (one block of RH_SMALL_THREADS threads): the assembly of
// rh_newton_assemble into A, whose extra row p holds g, so that the
// factorisation also makes the forward solution (row p of column j becomes
// y_j), then a right-looking Cholesky by panels of 32 columns:
//  - warp 0 factors the panel's diagonal tile, lane l holding its row l in
//    registers, with shuffles and no barrier (per column: the pivot, its
//    square root, L_ij = a_ij · (1 / L_jj) as LAPACK's potf2 scales, and the
//    tile's rank-one update);
//  - one thread per row below the tile (row p included) solves its row
//    against the tile, the row in registers;
//  - a warp per trailing column subtracts the panel's product from it.
// Three block barriers per panel. Then Lᵀ x = y by tiles from the last: warp
// 0 solves the tile's rows in registers, the block subtracts their part from
// the rows above. Same outputs as rh_newton_solve: L (lower, column-major; the
// upper triangle the assembled H) in H, the assembled matrix in Hs, g, D and
// the potrf-style info (k + 1 for the first non-positive pivot; then D = g).
// Dynamic shared memory: (p·p + 3p) values of T.
// ---------------------------------------------------------------------------

// Factor the diagonal tile of rows and columns k0 .. k0 + kw − 1 (kw ≤ 32) of
// A (leading dimension ld) in place, lane l holding row k0 + l: one column at
// a time, warp shuffles only. The reciprocals of its diagonal go to rinv.
// Returns 0 or the potrf-style info of a non-positive pivot (warp-uniform); a
// failed tile is not written back.
template <typename T>
__device__ __forceinline__ int tile_factor(T* A, int ld, int k0, int kw, T* rinv, int lane) {
  const int r = k0 + lane;
  T t[32];
#pragma unroll
  for (int c = 0; c < 32; ++c) t[c] = (lane < kw && c <= lane) ? A[r + (k0 + c) * ld] : T(0);
  int fail = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    if (j >= kw) break;
    const T d = __shfl_sync(FULL_MASK, t[j], j);
    if (!(d > T(0))) {  // the same pivot in every lane: a uniform exit
      fail = k0 + j + 1;
      break;
    }
    const T ljj = sqrtv(d);
    const T inv = T(1) / ljj;
    // lanes above j compute values of the upper triangle, never written back
    const T lij = t[j] * inv;
    t[j] = lane == j ? ljj : lij;
    if (lane == j) rinv[k0 + j] = inv;
#pragma unroll
    for (int c = j + 1; c < 32; ++c) t[c] = t[c] - lij * __shfl_sync(FULL_MASK, lij, c);
  }
  if (fail == 0 && lane < kw) {
#pragma unroll
    for (int c = 0; c < 32; ++c)
      if (c <= lane) A[r + (k0 + c) * ld] = t[c];
  }
  return fail;
}

// The rows k0 + kw .. q of A (row q: the right-hand side) against the
// factored tile: L_ij = (a_ij − Σ_{c<j} L_ic L_jc) · (1 / L_jj), one thread
// per row, column-oriented so that the updates of a column are independent.
// The row goes through registers in two halves of 16 columns (32 values of
// double would spill): the second half first takes the first half's updates,
// in the same order as one pass would.
template <typename T>
__device__ __forceinline__ void panel_solve(T* A, int ld, int q, int k0, int kw, const T* rinv) {
  constexpr int HALF = 16;
  for (int i = k0 + kw + (int)threadIdx.x; i <= q; i += blockDim.x) {
    T* row = A + i + k0 * ld;  // the row's column k0 + c at row[c * ld]
#pragma unroll
    for (int h = 0; h < 32; h += HALF) {
      if (h >= kw) break;
      const int hw = kw - h < HALF ? kw - h : HALF;
      T x[HALF];
#pragma unroll
      for (int c = 0; c < HALF; ++c) x[c] = c < hw ? row[(h + c) * ld] : T(0);
      for (int j = 0; j < h; ++j) {  // the first half's columns, solved
        const T xj = row[j * ld];
        const T* lj = A + k0 + h + (k0 + j) * ld;  // the same address in every lane
#pragma unroll
        for (int c = 0; c < HALF; ++c)
          if (c < hw) x[c] = x[c] - lj[c] * xj;
      }
#pragma unroll
      for (int j = 0; j < HALF; ++j) {
        if (j >= hw) break;
        x[j] = x[j] * rinv[k0 + h + j];
        const T* lj = A + k0 + h + (k0 + h + j) * ld;
#pragma unroll
        for (int c = j + 1; c < HALF; ++c)
          if (c < hw) x[c] = x[c] - lj[c] * x[j];
      }
#pragma unroll
      for (int c = 0; c < HALF; ++c)
        if (c < hw) row[(h + c) * ld] = x[c];
    }
  }
}

// a_ic −= Σ_j L_ij L_cj over the panel's columns k0 .. k0 + kw − 1, for the
// trailing columns c ≥ k0 + kw and their rows c ≤ i ≤ q: a warp per column,
// a lane per row.
template <typename T>
__device__ __forceinline__ void trailing_update(T* A, int ld, int q, int k0, int kw) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int c = k0 + kw + warp; c < q; c += nwarps) {
    for (int i = c + lane; i <= q; i += 32) {
      T s = A[i + c * ld];
#pragma unroll 8
      for (int j = 0; j < kw; ++j) s = s - A[i + (k0 + j) * ld] * A[c + (k0 + j) * ld];
      A[i + c * ld] = s;
    }
  }
}

// Lᵀ x = y in place in vec, tiles from the last: warp 0 solves the tile's
// rows, lane l holding x_l and the tile's column l in registers (x_j = v_j ·
// (1 / L_jj), then v_l −= L_jl x_j for l < j); then the block subtracts the
// tile's part from the rows above it, a thread per row.
template <typename T>
__device__ __forceinline__ void tiles_back_solve(const T* A, int ld, int q, const T* rinv,
                                                 T* vec) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k0 = ((q - 1) >> 5) << 5; k0 >= 0; k0 -= 32) {
    const int kw = q - k0 < 32 ? q - k0 : 32;
    if (warp == 0) {
      T lt[32];  // L_(k0+j),(k0+lane) below the diagonal, else 0
#pragma unroll
      for (int j = 0; j < 32; ++j)
        lt[j] = (j > lane && j < kw) ? A[k0 + j + (k0 + lane) * ld] : T(0);
      T v = lane < kw ? vec[k0 + lane] : T(0);
      const T rl = lane < kw ? rinv[k0 + lane] : T(0);
#pragma unroll
      for (int j = 31; j >= 0; --j) {
        if (j >= kw) continue;
        const T xj = __shfl_sync(FULL_MASK, v * rl, j);
        v = lane == j ? xj : (lane < j ? v - lt[j] * xj : v);
      }
      if (lane < kw) vec[k0 + lane] = v;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < k0; r += blockDim.x) {
      T s = vec[r];
      for (int i = 0; i < kw; ++i) s = s - A[k0 + i + r * ld] * vec[k0 + i];
      vec[r] = s;
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_newton_solve_tiles(const T* __restrict__ C, const T* __restrict__ J,
                      const T* __restrict__ beta, const T* __restrict__ beta0, long long p,
                      double* __restrict__ ctl, T* __restrict__ H, T* __restrict__ Hs,
                      T* __restrict__ g, T* __restrict__ D) {
  extern __shared__ double smem_d[];
  const int q = (int)p, ld = q + 1;
  T* A = reinterpret_cast<T*>(smem_d);  // rows 0..q of columns 0..q−1, column-major; row q: g
  T* vec = A + ld * q;                  // g, then y, then the solution
  T* rinv = vec + q;                    // the reciprocals of L's diagonal
  __shared__ int s_fail;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  assemble_system(q, C, J, beta, beta0, ctl, A, Hs, g, vec, ld);
  __syncthreads();
  for (int j = threadIdx.x; j < q; j += blockDim.x) A[q + j * ld] = vec[j];
  if (threadIdx.x == 0) s_fail = 0;
  __syncthreads();
  int fail = 0;
  for (int k0 = 0; k0 < q; k0 += 32) {
    const int kw = q - k0 < 32 ? q - k0 : 32;
    if (warp == 0) {
      const int f = tile_factor(A, ld, k0, kw, rinv, lane);
      if (lane == 0) s_fail = f;
    }
    __syncthreads();
    fail = s_fail;  // the same for every thread: a uniform exit
    if (fail != 0) break;
    panel_solve(A, ld, q, k0, kw, rinv);
    __syncthreads();
    trailing_update(A, ld, q, k0, kw);
    __syncthreads();
  }
  if (fail == 0) {
    for (int j = threadIdx.x; j < q; j += blockDim.x) vec[j] = A[q + j * ld];
    __syncthreads();
    tiles_back_solve(A, ld, q, rinv, vec);
  }
  // No barrier needed: the back solve ends on one, and a failed factorisation
  // leaves the loop right after one (a failed tile writes nothing to A).
  publish_solve(q, ld, A, vec, fail, ctl, H, D);
}

// ---------------------------------------------------------------------------
// Newton, step 3: zdir = Z·D and, in the same pass, the remainder sums
// Σ w R(t_k · zdir) for every step t_k = 2^-k of the contract's backtracking
// (lane k of each warp owns step k). The last block checks the Cholesky
// factor (scale-invariant pivot test, finite D), takes the first step whose
// objective change is not positive, updates β and tests convergence.
// `force` = 1 skips the factor checks (D came from the host's fallback).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_newton_search(const T* __restrict__ Z, long long ldz, long long n, long long p,
                 const T* __restrict__ r, const T* __restrict__ w, const T* __restrict__ D,
                 const T* __restrict__ g, const T* __restrict__ J, const T* __restrict__ L,
                 const T* __restrict__ Hs, double* __restrict__ ctl, T* __restrict__ beta,
                 double* __restrict__ partials, double* status, long long force,
                 const double* __restrict__ jv) {
  // The host launches a step only while the solve runs; a refused batch's
  // first step returns here (its status is rh_build's, with the flag).
  if (!solve_open(ctl_ints(ctl))) return;
  extern __shared__ double smem_d[];
  T* sd = reinterpret_cast<T*>(smem_d);
  __shared__ double red[(MAX_WARPS + 1) * 32];
  __shared__ double red2[MAX_WARPS * 3];
  __shared__ int s_mode;
  __shared__ double s_t;
  for (long long j = threadIdx.x; j < p; j += blockDim.x) sd[j] = D[j];
  __syncthreads();
  const T tau = (T)ctl[RH_P_TAU];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  const T tk = lane < RH_LINE_SEARCH_STEPS ? (T)ldexp(1.0, -lane) : T(0);
  double acc = 0.0;
  for (long long i0 = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i0 < n; i0 += RH_ROWS * nw) {
    T dots[RH_ROWS];
    rows_dot<RH_ROWS>(Z, ldz, i0, nw, n, sd, p, lane, dots);
#pragma unroll
    for (int rr = 0; rr < RH_ROWS; ++rr) {
    const long long i = i0 + rr * nw;
    if (i >= n) break;
    const T zd = dots[rr];
    if (lane < RH_LINE_SEARCH_STEPS) {
      const T ri = r[i];
      const T psi = clip(ri, -tau, tau);
      const T over = ri - psi, lo = -tau - psi, hi = tau - psi;
      T dp = zd * tk;  // exact: t_k is a power of two
      dp = dp + over;
      T u = clip(dp, lo, hi);
      dp = dp - u * T(0.5);
      u = u * dp;
      acc += (double)(w[i] * u);
    }
    }
  }
  int* ci = ctl_ints(ctl);
  if (!lane_grid_reduce(acc, partials, reinterpret_cast<unsigned int*>(ci + RH_I_TICKET), red))
    return;

  // ---- last block: decide the iteration ----
  double v[3] = {0.0, 0.0, 0.0};  // gᵀD, DᵀJD, failed checks
  const double rtol = ctl[RH_P_RTOL];
  if (jv != nullptr) {  // wide: JD from rh_wide_symv
    for (long long a = threadIdx.x; a < p; a += blockDim.x) v[1] += (double)sd[a] * jv[a];
  } else {
    block_symv<1>(
        J, (int)p, [&](int b, int) { return (double)sd[b]; },
        [&](int a, int, double jd) { v[1] += (double)sd[a] * jd; }, red, MAX_WARPS * 32);
  }
  for (long long a = threadIdx.x; a < p; a += blockDim.x) {
    const double da = (double)sd[a];
    v[0] += (double)g[a] * da;
    if (!finite_v(sd[a])) v[2] += 1.0;
    if (!force) {
      const double hd = (double)Hs[a * p + a];
      const double l = (double)L[a * p + a];
      const double ratio = hd > 0.0 ? (l * l) / hd : 0.0;
      if (!(ratio > rtol)) v[2] += 1.0;
    }
  }
  block_sum<3>(v, red2);
  if (threadIdx.x == 0) {
    s_mode = 0;
    ctl[RH_S_SLOPE] = v[0];
    const bool bad = v[2] > 0.0 || (!force && ci[RH_I_INFO] != 0);
    if (bad) {
      ci[RH_I_FALLBACK] = 1;
    } else {
      ci[RH_I_FALLBACK] = 0;
      const double total = ctl[RH_P_TOTAL];
      int accepted = -1;
      for (int k = 0; k < RH_LINE_SEARCH_STEPS; ++k) {
        const double t = ldexp(1.0, -k);
        // F(β − tD) − F(β) in the difference form of rh_dask.core
        const double change = -t * v[0] + (red[MAX_WARPS * 32 + k] + 0.5 * t * t * v[1]) / total;
        if (!(change > 0.0)) {
          accepted = k;
          break;
        }
      }
      ci[RH_I_ITER] += 1;
      if (accepted < 0) {
        record_stall(ci);
      } else {
        ci[RH_I_ACCEPT] = 1;
        s_t = ldexp(1.0, -accepted);
        ctl[RH_S_T] = s_t;
        s_mode = 1;
      }
    }
  }
  __syncthreads();
  if (s_mode == 1) {
    const T tt = (T)s_t;
    double q[2] = {0.0, 0.0};
    for (long long a = threadIdx.x; a < p; a += blockDim.x) {
      const T old = beta[a];
      const T nb = old - mul_rn(tt, sd[a]);
      const T st = nb - old;
      beta[a] = nb;
      q[0] += (double)st * (double)st;
      q[1] += (double)nb * (double)nb;
    }
    block_sum<2>(q, red2);
    if (threadIdx.x == 0) record_step(ctl, ci, sqrt(q[0]), sqrt(q[1]));
  }
  mirror_status(ctl, status);
}

// ---------------------------------------------------------------------------
// Commit, step 1: r at the final β, M = w κ(r) ⊙ Z for the information update
// and the loss Σ w ρ(r) for the objective diagnostic.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_commit_eval(const T* __restrict__ Z, long long ldz, long long n, long long p,
               const T* __restrict__ y, const T* __restrict__ w, const T* __restrict__ beta,
               double* __restrict__ ctl, T* __restrict__ M, long long ldm,
               double* __restrict__ partials, double* status) {
  // Queued after every LAMM round group: a no-op until the solve is done,
  // and for a batch that failed validation.
  if (!commit_due(ctl_ints(ctl))) return;
  if (eval_rows<false>(Z, ldz, n, p, y, w, beta, ctl, (T*)nullptr, M, ldm, partials))
    mirror_status(ctl, status);
}

// ---------------------------------------------------------------------------
// Commit, step 2 (one block): objective diagnostic, J ← J + sym(C), β ← β_work.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_SMALL_THREADS)
rh_commit_finish(const T* __restrict__ C, T* __restrict__ J, const T* __restrict__ beta_w,
                 const T* beta0, long long p, double* __restrict__ ctl, T* beta_out,
                 double* status, T* __restrict__ beta_host,
                 const double* __restrict__ jv) {
  // beta0 and beta_out are the same buffer (the committed β): it is read
  // before the barrier in block_sum and written after it. beta_host is a
  // host-mapped copy, read by the host after it synchronises (no D2H copy).
  // Queued after every iteration: commits once, when the solve is done, and
  // never for a batch that failed validation (rh_build set the flag; the host
  // raises after its first synchronisation, when these kernels have run).
  int* ci = ctl_ints(ctl);
  if (!commit_due(ci)) return;
  __shared__ double red[MAX_WARPS * 3];
  const bool has_hist = ctl[RH_P_HAS_HIST] != 0.0;
  __shared__ double scratch[RH_SMALL_THREADS];
  double v[3] = {0.0, 0.0, 0.0};  // ΔᵀJΔ, Δᵀs, ‖β ⊙ m‖₁
  if (jv != nullptr) {  // wide: JΔ from rh_wide_symv, J + sym(C) by rh_wide_commit_gram
    for (long long a = threadIdx.x; a < p; a += blockDim.x)
      v[0] += (double)(beta_w[a] - beta0[a]) * jv[a];
  } else {
    block_symv<1>(
        J, (int)p, [&](int b, int) { return (double)(beta_w[b] - beta0[b]); },
        [&](int a, int, double jd) { v[0] += (double)(beta_w[a] - beta0[a]) * jd; }, scratch,
        RH_SMALL_THREADS);
  }
  for (long long a = threadIdx.x; a < p; a += blockDim.x) {
    const T da = beta_w[a] - beta0[a];
    const double m = mask_of(a, p, ctl);
    if (has_hist) v[1] += (double)da * (double)sign_of(beta0[a]) * m;
    v[2] += fabs((double)beta_w[a]) * m;
  }
  block_sum<3>(v, red);  // every thread has read J before anyone writes it
  const int q = (int)p;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (jv == nullptr) {
    for (int b = warp; b < q; b += nwarps)
      for (int a = lane; a < q; a += 32) {
        const int hi = a > b ? a : b, lo = a > b ? b : a;
        J[a + b * q] = J[a + b * q] + C[hi + lo * q];
      }
  }
  for (long long a = threadIdx.x; a < p; a += blockDim.x) {
    beta_out[a] = beta_w[a];
    beta_host[a] = beta_w[a];
  }
  if (threadIdx.x == 0) {
    double obj = (ctl[RH_S_LOSS] + 0.5 * v[0]) / ctl[RH_P_TOTAL];
    if (has_hist) obj -= ctl[RH_P_HIST] * v[1];
    if (ctl[RH_P_PENALISED] != 0.0) obj += ctl[RH_P_LAMBDA_VALUE] * v[2];
    ctl[RH_S_OBJ] = obj;
    ci[RH_I_COMMITTED] = 1;
  }
  mirror_status(ctl, status);
}

// ---------------------------------------------------------------------------
// LAMM, step 1: r and g(β) in one pass. Each warp accumulates w ψ(r_i) z_i
// into its own shared-memory row (lanes own columns: no atomics), blocks
// write their partial Zᵀ(wψ), the last block adds them in block order and
// forms g = (JΔ − Zᵀwψ)/N − hist·s. Skipped while a φ round of the same
// iteration is still pending (r and g are unchanged), once the solve is done
// and for a refused batch.
// Dynamic shared memory: nwarps·ldp doubles + p values of T.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_lamm_eval(const T* __restrict__ Z, long long ldz, long long n, long long p, long long ldp,
             const T* __restrict__ y, const T* __restrict__ w, const T* __restrict__ beta,
             const T* __restrict__ beta0, const T* __restrict__ J, double* __restrict__ ctl,
             T* __restrict__ r, T* __restrict__ g, double* __restrict__ partials,
             const double* __restrict__ jv) {
  int* ci = ctl_ints(ctl);
  if (!solve_open(ci) || ci[RH_I_TRIALS] != 0) return;
  extern __shared__ double smem_d[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  double* acc = smem_d;  // [nwarps][ldp]
  T* sb = reinterpret_cast<T*>(smem_d + (size_t)nwarps * ldp);
  for (long long j = threadIdx.x; j < (long long)nwarps * ldp; j += blockDim.x) acc[j] = 0.0;
  for (long long j = threadIdx.x; j < p; j += blockDim.x) sb[j] = beta[j];
  __syncthreads();
  const T tau = (T)ctl[RH_P_TAU];
  const long long nw = (long long)gridDim.x * nwarps;
  double* my = acc + (size_t)warp * ldp;
  for (long long i0 = (long long)blockIdx.x * nwarps + warp; i0 < n; i0 += RH_ROWS * nw) {
    T dots[RH_ROWS];
    rows_dot<RH_ROWS>(Z, ldz, i0, nw, n, sb, p, lane, dots);
#pragma unroll
    for (int rr = 0; rr < RH_ROWS; ++rr) {
      const long long i = i0 + rr * nw;
      if (i >= n) break;
      const T* zr = Z + i * ldz;
      const T ri = y[i] - dots[rr];
      const T v = w[i] * clip(ri, -tau, tau);
      for (long long j = lane; j < p; j += 32) my[j] += (double)(v * zr[j]);
      if (lane == 0) r[i] = ri;
    }
  }
  __syncthreads();
  for (long long j = threadIdx.x; j < p; j += blockDim.x) {
    double s = 0.0;
    for (int q = 0; q < nwarps; ++q) s += acc[(size_t)q * ldp + j];
    partials[(size_t)blockIdx.x * ldp + j] = s;
  }
  if (!arrive_last(reinterpret_cast<unsigned int*>(ci + RH_I_TICKET))) return;
  // Add the block partials in `slices` interleaved groups (more loads in
  // flight), then the groups in order: a fixed order, so fixed bits.
  long long slices = (long long)blockDim.x / ldp;
  slices = slices < 1 ? 1 : (slices > nwarps ? nwarps : slices);
  for (long long t = threadIdx.x; t < slices * ldp; t += blockDim.x) {
    const long long sl = t / ldp, a = t % ldp;
    double s = 0.0;
    if (a < p)
      for (long long b = sl; b < gridDim.x; b += slices) s += __ldcg(partials + (size_t)b * ldp + a);
    acc[sl * ldp + a] = s;
  }
  __syncthreads();
  const T inv = (T)ctl[RH_P_INV_TOTAL], hist = (T)ctl[RH_P_HIST];
  const bool has_hist = ctl[RH_P_HAS_HIST] != 0.0;
  __shared__ double scratch[RH_SMALL_THREADS];
  auto grad_sink = [&](int a, int, double jd) {
    double G = 0.0;
    for (long long sl = 0; sl < slices; ++sl) G += acc[sl * ldp + a];
    T ga = (T)jd - (T)G;
    ga = ga * inv;
    if (has_hist) ga = ga - mul_rn(hist, (T)(sign_of(beta0[a]) * (T)mask_of(a, p, ctl)));
    g[a] = ga;
  };
  if (jv != nullptr) {  // wide: J(β − β0) from rh_wide_symv
    for (int a = threadIdx.x; a < (int)p; a += blockDim.x) grad_sink(a, 0, jv[a]);
  } else {
    block_symv<1>(
        J, (int)p, [&](int b, int) { return (double)(beta[b] - beta0[b]); }, grad_sink, scratch,
        RH_SMALL_THREADS);
  }
  if (threadIdx.x == 0) *reinterpret_cast<unsigned int*>(ci + RH_I_TICKET) = 0u;
}

// ---------------------------------------------------------------------------
// LAMM, step 2: one round of RH_LAMM_ROUND majorisation trials φ_k = 2^k φ in
// one pass over Z. Every block forms the candidates c_k = S(β − g/φ_k, λm/φ_k)
// and steps e_k = c_k − β in shared memory (same code, same bits in every
// block); each warp computes the K products z_i·e_k of a row and lane k adds
// w R(−z_i·e_k). The last block takes the first k passing the majorisation
// test, or moves φ on by 2^K for the next round (up to RH_LAMM_MAX_TRIALS
// trials), and tests convergence.
// Dynamic shared memory: (K + 1)·ldp values of T.
// ---------------------------------------------------------------------------
// WIDE: the last block takes J e_k from rh_wide_lamm_symv (jv) instead of
// reading J itself (rh_lamm_trials_wide; a separate instantiation, so that the
// kernel of narrower designs is compiled exactly as without it).
template <bool WIDE, typename T>
__device__ __forceinline__ void
lamm_trials(const T* __restrict__ Z, long long ldz, long long n, long long p, long long ldp,
            const T* __restrict__ r, const T* __restrict__ w, const T* __restrict__ g,
            const T* __restrict__ J, double* __restrict__ ctl, T* __restrict__ beta,
            double* __restrict__ partials, double* status, const double* __restrict__ jv) {
  int* ci = ctl_ints(ctl);
  if (!solve_open(ci)) return;
  constexpr int K = RH_LAMM_ROUND;
  extern __shared__ double smem_d[];
  __shared__ double red[(MAX_WARPS + 1) * 32];
  __shared__ double red2[MAX_WARPS * 2 * K];
  __shared__ int s_k;
  T* E = reinterpret_cast<T*>(smem_d);  // [K][ldp]
  const double phi0 = ctl[RH_S_PHI];
  const T lam = (T)ctl[RH_P_LAM];
  lamm_steps(E, p, ldp, beta, g, ctl);
  const T tau = (T)ctl[RH_P_TAU];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  double acc = 0.0;
  for (long long i = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i < n; i += nw) {
    const T* zr = Z + i * ldz;
    T dots[K];
#pragma unroll
    for (int k = 0; k < K; ++k) dots[k] = T(0);
    for (long long j = lane; j < p; j += 32) {
      const T z = zr[j];
#pragma unroll
      for (int k = 0; k < K; ++k) dots[k] += z * E[(size_t)k * ldp + j];
    }
    T mine = T(0);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const T s = warp_sum(dots[k]);
      if (lane == k) mine = s;
    }
    if (lane < K) {
      const T ri = r[i];
      const T psi = clip(ri, -tau, tau);
      const T over = ri - psi, lo = -tau - psi, hi = tau - psi;
      T dp = -mine;  // δ = −Z e
      dp = dp + over;
      T u = clip(dp, lo, hi);
      dp = dp - u * T(0.5);
      u = u * dp;
      acc += (double)(w[i] * u);
    }
  }
  if (!lane_grid_reduce(acc, partials, reinterpret_cast<unsigned int*>(ci + RH_I_TICKET), red))
    return;

  // ---- last block: majorisation tests of the K trials ----
  double v[2 * K];  // eᵀJe and eᵀe per trial
#pragma unroll
  for (int k = 0; k < 2 * K; ++k) v[k] = 0.0;
  auto trial_sink = [&](int a, int kk, double je) {
    const double ea = (double)E[(size_t)kk * ldp + a];
    v[kk] += ea * je;
    v[K + kk] += ea * ea;
  };
  if (WIDE) {
    for (int a = threadIdx.x; a < (int)p; a += blockDim.x)
      for (int kk = 0; kk < K; ++kk) trial_sink(a, kk, jv[(size_t)kk * p + a]);
  } else {
    block_symv<K>(
        J, (int)p, [&](int b, int kk) { return (double)E[(size_t)kk * ldp + b]; }, trial_sink,
        red, MAX_WARPS * 32);
  }
  block_sum<2 * K>(v, red2);
  if (threadIdx.x == 0) {
    const double total = ctl[RH_P_TOTAL];
    s_k = -1;
    for (int k = 0; k < K; ++k) {
      const double phi = phi0 * ldexp(1.0, k);
      const double excess = (red[MAX_WARPS * 32 + k] + 0.5 * v[k]) / total;
      if (excess <= 0.5 * phi * v[K + k] + RH_LAMM_SLACK) {
        s_k = k;
        break;
      }
    }
    if (s_k < 0) {
      ci[RH_I_TRIALS] += K;
      ctl[RH_S_PHI] = phi0 * ldexp(1.0, K);
      if (ci[RH_I_TRIALS] >= RH_LAMM_MAX_TRIALS) {
        ci[RH_I_ITER] += 1;
        record_stall(ci);
      }
    }
  }
  __syncthreads();
  const int ks = s_k;
  if (ks >= 0) {
    const double phik = phi0 * ldexp(1.0, ks);
    const T ip = (T)(1.0 / phik);
    double q[1] = {0.0};
    for (long long a = threadIdx.x; a < p; a += blockDim.x) {
      // the same expression as above: β becomes exactly the tested candidate
      const T bj = beta[a];
      const T x = bj - mul_rn(g[a], ip);
      const T thr = mul_rn((T)mask_of(a, p, ctl) * lam, ip);
      const T mag = absv(x) - thr;
      const T c = sign_of(x) * (mag > T(0) ? mag : T(0));
      beta[a] = c;
      q[0] += (double)c * (double)c;
    }
    block_sum<1>(q, red2);
    if (threadIdx.x == 0) {
      const double half = phik / 2.0;
      ctl[RH_S_PHI] = half > RH_LAMM_MIN_PHI ? half : RH_LAMM_MIN_PHI;
      ci[RH_I_TRIALS] = 0;
      ci[RH_I_ITER] += 1;
      ci[RH_I_ACCEPT] = 1;
      record_step(ctl, ci, sqrt(v[K + ks]), sqrt(q[0]));
    }
  }
  mirror_status(ctl, status);
}

template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_lamm_trials(const T* __restrict__ Z, long long ldz, long long n, long long p, long long ldp,
               const T* __restrict__ r, const T* __restrict__ w, const T* __restrict__ g,
               const T* __restrict__ J, double* __restrict__ ctl, T* __restrict__ beta,
               double* __restrict__ partials, double* status) {
  lamm_trials<false>(Z, ldz, n, p, ldp, r, w, g, J, ctl, beta, partials, status, nullptr);
}

template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_lamm_trials_wide(const T* __restrict__ Z, long long ldz, long long n, long long p,
                    long long ldp, const T* __restrict__ r, const T* __restrict__ w,
                    const T* __restrict__ g, const T* __restrict__ J, double* __restrict__ ctl,
                    T* __restrict__ beta, double* __restrict__ partials, double* status,
                    const double* __restrict__ jv) {
  lamm_trials<true>(Z, ldz, n, p, ldp, r, w, g, J, ctl, beta, partials, status, jv);
}

// ---------------------------------------------------------------------------
// Prediction for device input: out = X β[:d] (+ β[d]).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_predict(const T* __restrict__ X, long long ldx, long long n, long long d,
           const T* __restrict__ beta, long long intercept, T* __restrict__ out) {
  extern __shared__ double smem_d[];
  T* sb = reinterpret_cast<T*>(smem_d);
  for (long long j = threadIdx.x; j < d + intercept; j += blockDim.x) sb[j] = beta[j];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long i = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i < n; i += nw) {
    T v = row_dot(X + i * ldx, sb, d, lane);
    if (intercept) v += sb[d];
    if (lane == 0) out[i] = v;
  }
}

// ---------------------------------------------------------------------------
// The score variance's rows at the committed β: S = s ⊙ Z with
// s = |clip(y − Zβ, ±τ)| · √w (row stride lds), so that K += SᵀS is one GEMM
// (batch.py, once the batch is committed). β is the committed one, τ the
// control block's.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_score_gram_rows(const T* __restrict__ Z, long long ldz, long long n, long long p,
                   const T* __restrict__ y, const T* __restrict__ w,
                   const T* __restrict__ beta, const double* __restrict__ ctl,
                   T* __restrict__ S, long long lds) {
  extern __shared__ double smem_d[];
  T* sb = reinterpret_cast<T*>(smem_d);
  for (long long j = threadIdx.x; j < p; j += blockDim.x) sb[j] = beta[j];
  __syncthreads();
  const T tau = (T)ctl[RH_P_TAU];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long nw = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long i = (long long)blockIdx.x * (blockDim.x >> 5) + warp; i < n; i += nw) {
    const T* zr = Z + i * ldz;
    const T ri = y[i] - row_dot(zr, sb, p, lane);
    const T s = mul_rn(absv(clip(ri, -tau, tau)), sqrtv(w[i]));
    T* sr = S + i * lds;
    for (long long j = lane; j < p; j += 32) sr[j] = mul_rn(zr[j], s);
  }
}
