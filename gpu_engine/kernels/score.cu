// Prequential scores of a grid of configurations on one batch (compiled at run
// time by NVRTC through gpu_engine/grid.py, which prepends the RH_* layout
// constants of gpu_engine/layout.py and instantiates rh_score_rows for float
// and double).
//
// Before a grid trains on a batch, every configuration c is scored on it at
// its current coefficients beta_c: the weighted mean Huber loss at a
// reference tau and the weighted mean absolute error, with
// r = y - (x . beta_c[:d] + beta_c[d]), the prediction in the batch's dtype T
// (as the engine predicts), r and the losses in double.
//
// Bits: configuration c's sums depend only on the batch, beta_c and the grid
// size (a function of the row count and the device), never on how many other
// configurations share the launch or where c sits among them, so that a grid
// split over several actors scores every configuration bit for bit as one
// grid. No atomics: blocks write partial sums, rh_score_finish adds them in
// block order.

#define FULL_MASK 0xffffffffu
#define MAX_WARPS (RH_ROW_THREADS / 32)

namespace {

template <typename T>
__device__ __forceinline__ T lane_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;  // the xor butterfly leaves the same value in every lane
}

}  // namespace

// Block (b, c) sums w*rho(r), w*|r| and w over the rows it owns (one warp per
// row, lanes striding the columns, warps striding the rows grid-wide), into
// partials[((c * gridDim.x) + b) * 3 + {0, 1, 2}]. `betas` holds one
// coefficient vector per configuration, `ldb` apart, the intercept last;
// `w` may be null (every row weighs 1).
template <typename T>
__global__ void __launch_bounds__(RH_ROW_THREADS)
rh_score_rows(const T* __restrict__ X, long long ldx, long long n, long long d,
              const T* __restrict__ y, const T* __restrict__ w, const T* __restrict__ betas,
              long long ldb, long long intercept, double tau, double* __restrict__ partials) {
  extern __shared__ double smem_d[];
  T* sb = reinterpret_cast<T*>(smem_d);
  __shared__ double red[MAX_WARPS * 3];
  const T* beta = betas + (long long)blockIdx.y * ldb;
  for (long long j = threadIdx.x; j < d + intercept; j += blockDim.x) sb[j] = beta[j];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const long long nw = (long long)gridDim.x * nwarps;
  double loss = 0.0, absolute = 0.0, weight = 0.0;
  for (long long i = (long long)blockIdx.x * nwarps + warp; i < n; i += nw) {
    const T* x = X + i * ldx;
    T acc = T(0);
    for (long long j = lane; j < d; j += 32) acc += x[j] * sb[j];
    T prediction = lane_sum(acc);
    if (intercept) prediction += sb[d];
    const double r = (double)y[i] - (double)prediction;
    const double psi = r < -tau ? -tau : (r > tau ? tau : r);  // numpy.clip
    const double rho = psi * (r - 0.5 * psi);
    const double wi = w == nullptr ? 1.0 : (double)w[i];
    loss += wi * rho;
    absolute += wi * fabs(r);
    weight += wi;
  }
  if (lane == 0) {
    red[warp * 3 + 0] = loss;
    red[warp * 3 + 1] = absolute;
    red[warp * 3 + 2] = weight;
  }
  __syncthreads();
  if (threadIdx.x < 3) {
    double s = 0.0;
    for (int k = 0; k < nwarps; ++k) s += red[k * 3 + threadIdx.x];
    partials[((size_t)blockIdx.y * gridDim.x + blockIdx.x) * 3 + threadIdx.x] = s;
  }
}

// One thread per configuration adds its blocks' partial sums in block order and
// writes the means: out[2c] = sum w*rho / sum w, out[2c + 1] = sum w*|r| / sum w
// (host-mapped memory, read after the stream is synchronised).
extern "C" __global__ void rh_score_finish(const double* __restrict__ partials, long long blocks,
                                           long long k, double* out) {
  const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= k) return;
  double loss = 0.0, absolute = 0.0, weight = 0.0;
  for (long long b = 0; b < blocks; ++b) {
    const double* part = partials + (c * blocks + b) * 3;
    loss += part[0];
    absolute += part[1];
    weight += part[2];
  }
  out[2 * c] = loss / weight;
  out[2 * c + 1] = absolute / weight;
  __threadfence_system();
}
