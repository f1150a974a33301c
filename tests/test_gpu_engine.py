"""The GPU engine against the NumPy reference, on a real CUDA device.

Every test here is marked ``gpu`` and the module is skipped (with the reason)
where CuPy or a CUDA device is missing, as on CI. On a GPU machine:

    PYTHONPATH=. pytest -q -m gpu tests/test_gpu_engine.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="the GPU engine needs CuPy")


def _device_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_device_count() == 0, reason="no CUDA device visible to CuPy"),
]

from golden_corpus import load_cases, replay_case  # noqa: E402

from gpu_engine import GpuEngine  # noqa: E402
from rh_dask import HuberConfig, NumpyEngine, RenewableHuberRegressor  # noqa: E402
from rh_dask.datasets import StreamSpec  # noqa: E402
from rh_dask.exceptions import (  # noqa: E402
    EngineUnavailableError,
    NotFittedError,
    ValidationError,
)
from rh_dask.state import HuberState  # noqa: E402

TOL = {"float64": (1e-8, 2e-9), "float32": (3e-4, 3e-5)}

#: The issue's four shapes with fewer rows (widths and batch sizes kept), and a
#: short last batch where the stream does not divide evenly.
SHAPES = {
    "latency": (16, [4096, 4096]),
    "reference": (90, [32768, 32768, 1000]),
    "wide": (256, [4096, 4096, 4096]),
    "streaming": (32, [65536, 65536, 5000]),
}


def _stream(features: int, sizes: list[int], dtype: str, seed: int = 7):
    spec = StreamSpec(n_features=features, seed=seed)
    X, y = spec.chunk(0, sum(sizes), "float64")
    X, y = X.astype(dtype), y.astype(dtype)
    out, start = [], 0
    for size in sizes:
        out.append((X[start : start + size], y[start : start + size]))
        start += size
    return out


def _assert_close(actual, expected, dtype, what):
    rtol, atol = TOL[np.dtype(dtype).name]
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, what
    bound = atol + rtol * np.abs(expected)
    diff = np.abs(actual - expected)
    worst = float(np.max(diff / bound)) if diff.size else 0.0
    assert np.all(diff <= bound), f"{what}: worst |diff|/bound = {worst:.3g}"


def _kappa_noise(config, X, y, w, beta_gpu, beta_ref, bandwidth):
    """How far rounding alone can move this batch's Gram, entry by entry.

    κ(r) has slope 1/(2h) on the band |r| ∈ [τ − h, τ + h], and h ~ 1/√N is
    small for large batches (1e-3 at 32,768 rows), so rows in the band turn
    float32-size differences of r (the engines' β differ by float32 rounding,
    and r itself is rounded) into differences of κ of up to 1e-3, and every
    such row moves every entry of J by Δκ·|z_a z_b|. Small off-diagonal
    entries of J then move by far more than 3e-5 + 3e-4·|J|: the NumPy
    float32 engine itself misses its own float64 result by up to ~80 times
    that bound at these sizes. This is the bound on that effect: rows whose
    κ can move, times how far; zero for rows away from the band. The same
    holds in float64 with its own unit where the band is steep and p large
    (the wide test's J: 1.7e5 times the contract's bound at batch 0).
    """
    Z = np.asarray(X, dtype=np.float64)
    if config.fit_intercept:
        Z = np.column_stack([Z, np.ones(len(Z))])
    b_ref = np.asarray(beta_ref, dtype=np.float64)
    b_gpu = np.asarray(beta_gpu, dtype=np.float64)
    y64 = np.asarray(y, dtype=np.float64)
    absZ = np.abs(Z)
    eps = float(np.finfo(np.dtype(config.dtype)).eps)
    # β differs by what the two engines' states differ by; r's own rounding is
    # one unit of its terms for each engine (the NumPy float32 engine stays
    # within 16% of this allowance against its float64 self).
    dr = absZ @ np.abs(b_gpu - b_ref) + 2 * eps * (np.abs(y64) + absZ @ np.abs(b_ref))
    r = y64 - Z @ b_ref
    band = np.abs(np.abs(r) - config.tau) <= bandwidth + dr
    dk = np.where(band, np.minimum(1.0, dr / (2 * bandwidth)), 0.0)
    if w is not None:
        dk = dk * np.asarray(w, dtype=np.float64)
    return (absZ * dk[:, None]).T @ absZ


def _assert_states_close(gpu: HuberState, ref: HuberState, dtype, what="", noise=None):
    """Counters exact, β and J within the contract's tolerance of the reference.

    With ``noise`` (float32, or where asked for), J may in addition differ by
    the κ rounding noise of :func:`_kappa_noise` (accumulated over the
    stream), entry by entry.
    """
    assert gpu.counters() == ref.counters(), what
    assert gpu.coefficients.dtype == np.dtype(dtype)
    _assert_close(gpu.coefficients, ref.coefficients, dtype, f"{what} coefficients")
    if noise is None:
        _assert_close(gpu.information, ref.information, dtype, f"{what} information")
        return
    rtol, atol = TOL[np.dtype(dtype).name]
    expected = ref.information.astype(np.float64)
    diff = np.abs(gpu.information.astype(np.float64) - expected)
    bound = atol + rtol * np.abs(expected)
    print(
        f"{what}: {dtype} J, worst |diff|/contract bound {np.max(diff / bound):.3g}, "
        f"worst |diff|/(bound + κ noise) {np.max(diff / (bound + noise)):.3g}"
    )
    assert np.all(diff <= bound + noise), f"{what} information beyond the κ rounding noise"


def _differential(config, batches, device_input=False, weights=None, kappa_noise=None, **options):
    """Feed the same batches to both engines; compare after every batch.

    ``kappa_noise``: whether J may differ by :func:`_kappa_noise` (None: for
    float32 only).
    """
    ref = NumpyEngine(config)
    gpu = GpuEngine(config, **options)
    if kappa_noise is None:
        kappa_noise = config.dtype == "float32"
    noise = 0.0 if kappa_noise else None
    for i, (X, y) in enumerate(batches):
        w = None if weights is None else weights[i]
        d_ref = ref.partial_fit(X, y, w)
        if device_input:
            d_gpu = gpu.partial_fit(
                cp.asarray(X), cp.asarray(y), None if w is None else cp.asarray(w)
            )
        else:
            d_gpu = gpu.partial_fit(X, y, w)
        what = f"batch {i}"
        s_gpu, s_ref = gpu.export_state(), ref.export_state()
        if noise is not None:
            noise = noise + _kappa_noise(
                config, X, y, w, s_gpu.coefficients, s_ref.coefficients, d_ref.bandwidth
            )
        _assert_states_close(s_gpu, s_ref, config.dtype, what, noise)
        assert gpu.last_batch_weight == ref.last_batch_weight, what
        assert d_gpu.converged == d_ref.converged, (what, d_gpu, d_ref)
        for key in ("objective", "lambda_value", "bandwidth"):
            _assert_close(getattr(d_gpu, key), getattr(d_ref, key), config.dtype, key)
    return gpu, ref


@pytest.mark.parametrize("penalty", ["none", "l1"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_the_reference_in_all_sixteen_configurations(shape, dtype, penalty):
    features, sizes = SHAPES[shape]
    config = HuberConfig(penalty=penalty, dtype=dtype)
    gpu, _ = _differential(config, _stream(features, sizes, dtype), device_input=True)
    gpu.close()


@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_host_input_matches_the_reference_with_weights_and_no_intercept(penalty):
    rng = np.random.default_rng(3)
    batches = _stream(12, [3000, 2500, 700], "float64", seed=3)
    weights = [rng.integers(0, 4, size=len(y)).astype(np.float64) for _, y in batches]
    for w in weights:
        w[0] = 1.0
    config = HuberConfig(penalty=penalty, fit_intercept=False)
    gpu, _ = _differential(config, batches, weights=weights)
    gpu.close()


@pytest.mark.parametrize("device_input", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_real_valued_weights_give_the_references_weight_sum_to_the_last_bit(dtype, device_input):
    # Σw is a counter: the GPU's double-double grid reduction and the
    # reference's exact sum round to the same float64 (math.fsum's). Sizes
    # from one block to a few hundred; weights that no order sums exactly.
    rng = np.random.default_rng(21)
    batches = _stream(4, [20_000, 300, 250_000], dtype, seed=21)
    weights = [rng.uniform(0.5, 2.0, len(y)).astype(dtype) for _, y in batches]
    weights[2] *= np.asarray(np.pi, dtype)  # another exponent range
    gpu, ref = _differential(
        HuberConfig(dtype=dtype), batches, device_input=device_input, weights=weights
    )
    expected = 0.0
    for w in weights:
        expected = expected + math.fsum(w.astype(np.float64).tolist())
    assert gpu.export_state().weight_sum == ref.export_state().weight_sum == expected
    gpu.close()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_rank_deficient_design_takes_the_fallback_like_the_reference(dtype):
    batches = []
    for X, y in _stream(6, [800, 800, 500], dtype, seed=11):
        batches.append((np.ascontiguousarray(np.column_stack([X, X[:, 2]])), y))
    config = HuberConfig(ridge=0.0, dtype=dtype)
    gpu, _ = _differential(config, batches)
    beta = gpu.coefficients()
    # the duplicated column's coefficients share the weight (minimum norm)
    _assert_close(beta[2], beta[6], dtype, "duplicate columns")
    gpu.close()


def _assert_within_the_stopping_tolerance(config, batches, **options):
    """The GPU engine against the reference where the contract's bound is out of reach.

    With a duplicated column, no ridge and h ~ 0.005, every Newton system is
    singular (each step is a minimum-norm solution) and κ's ramp is steep, so
    the path depends on rounding: the engines may stop at different
    iterations (on an H100 machine, 37 minimum-norm steps in the first batch
    against the reference's 38), each
    within the stopping rule ‖step‖ ≤ tol (1 + ‖β‖) of the solution, where
    they differ in the row space by up to 5e-7 (not along the duplicated
    columns' null direction: 1e-11 there). So β may differ by the contract's
    bound plus twice that tolerance; J by the contract's bound plus the κ noise
    those β differences make (:func:`_kappa_noise`, accumulated over the
    stream). Counters are exact. The worst ratios are printed for the record.
    """
    ref, gpu = NumpyEngine(config), GpuEngine(config, **options)
    rtol, atol = TOL[config.dtype]
    noise = 0.0
    for i, (X, y) in enumerate(batches):
        d_ref = ref.partial_fit(X, y)
        gpu.partial_fit(X, y)
        s_gpu, s_ref = gpu.export_state(), ref.export_state()
        assert s_gpu.counters() == s_ref.counters(), i
        b_gpu, b_ref = (np.asarray(s.coefficients, np.float64) for s in (s_gpu, s_ref))
        stop = 2 * config.tol * (1 + float(np.linalg.norm(b_ref)))
        b_bound = atol + rtol * np.abs(b_ref) + stop
        noise = noise + _kappa_noise(config, X, y, None, b_gpu, b_ref, d_ref.bandwidth)
        j_gpu, j_ref = (np.asarray(s.information, np.float64) for s in (s_gpu, s_ref))
        j_bound = atol + rtol * np.abs(j_ref) + noise
        b_worst = float(np.max(np.abs(b_gpu - b_ref) / b_bound))
        j_worst = float(np.max(np.abs(j_gpu - j_ref) / j_bound))
        print(
            f"batch {i}: max |Δβ| {np.max(np.abs(b_gpu - b_ref)):.3g} "
            f"(worst/bound {b_worst:.3g}), max |ΔJ| {np.max(np.abs(j_gpu - j_ref)):.3g} "
            f"(worst/bound {j_worst:.3g})"
        )
        assert b_worst <= 1, f"batch {i} coefficients beyond the stopping tolerance"
        assert j_worst <= 1, f"batch {i} information beyond the κ noise"
    return gpu


@pytest.mark.parametrize("penalty", ["none", "l1"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_wide_designs_match_the_reference_and_repeat_bit_for_bit(dtype, penalty):
    """p = 601 (not a multiple of the 32-wide tiles) takes the grid kernels of wide designs.

    20,000 rows per batch: at β = 0 only about 4% of this stream's rows lie in
    κ's band, and with fewer than p of them the first Newton systems are
    singular. The contract's bound is then out of reach between any two
    summation orders (in float32 the minimum-norm steps differ, in float64 the
    iterates by up to 3e-10 and J through κ's ramp by 1e4 times the bound).
    At these sizes J still moves by κ's rounding noise in both dtypes.
    """
    from gpu_engine import layout

    batches = _stream(600, [20000, 20000, 700], dtype, seed=13)
    config = HuberConfig(penalty=penalty, dtype=dtype)
    gpu, _ = _differential(config, batches, device_input=True, kappa_noise=True, wide_kernels=True)
    assert gpu._ws.wide and gpu._ws.p >= layout.WIDE_MIN_P
    graphs = gpu.export_state()
    gpu.close()
    for options in ({"graphs": False}, {}):
        again = GpuEngine(config, wide_kernels=True, **options)
        for X, y in batches:
            again.partial_fit(cp.asarray(X), cp.asarray(y))
        assert again.export_state().equals(graphs), options
        again.close()


@pytest.mark.parametrize("features", [339, 699])
def test_l1_kernels_just_under_48_KiB_of_shared_memory_launch(features):
    """Dynamic shared memory above a kernel's default limit (48 KiB less its static arrays).

    float64, p = 340: rh_lamm_eval asks for 46,240 bytes beside 4 KiB of
    static arrays; p = 700: rh_lamm_trials asks for 44,800 beside 6.25 KiB.
    Both are under 48 KiB, where the limit was once left at its default.
    """
    config = HuberConfig(penalty="l1")
    gpu, _ = _differential(config, _stream(features, [1500, 1200], "float64", seed=19))
    gpu.close()


def test_wide_rank_deficient_design_takes_the_fallback_like_the_reference():
    batches = []
    for X, y in _stream(300, [1500, 1500], "float64", seed=17):
        batches.append((np.ascontiguousarray(np.column_stack([X, X[:, 2]])), y))
    config = HuberConfig(ridge=0.0)
    gpu = _assert_within_the_stopping_tolerance(config, batches, wide_kernels=True)
    assert gpu._ws.wide
    beta = gpu.coefficients()
    _assert_close(beta[2], beta[300], "float64", "duplicate columns")
    gpu.close()


@pytest.mark.parametrize("case", load_cases(), ids=lambda c: c.name)
def test_golden_corpus_replays_on_the_gpu(case):
    replay_case(case, lambda config: GpuEngine(config))


class _DeviceInputEngine:
    """Feeds the golden corpus through CuPy arrays."""

    def __init__(self, config):
        self.engine = GpuEngine(config)

    def partial_fit(self, X, y, sample_weight=None):
        w = None if sample_weight is None else cp.asarray(sample_weight)
        return self.engine.partial_fit(cp.asarray(X), cp.asarray(y), w)

    def export_state(self):
        return self.engine.export_state()


@pytest.mark.parametrize("case", load_cases()[:3], ids=lambda c: c.name)
def test_golden_corpus_replays_with_device_input(case):
    replay_case(case, _DeviceInputEngine)


@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_host_device_graph_and_prefetch_paths_give_identical_bits(penalty):
    batches = _stream(20, [5000, 5000, 1200], "float64", seed=5)
    config = HuberConfig(penalty=penalty)
    states = []
    for mode in ("host", "device", "eager", "stream"):
        engine = GpuEngine(config, graphs=mode != "eager")
        if mode == "stream":
            list(engine.partial_fit_stream(batches))
        for X, y in batches if mode != "stream" else ():
            if mode == "device":
                engine.partial_fit(cp.asarray(X), cp.asarray(y))
            else:
                engine.partial_fit(X, y)
        states.append(engine.export_state())
        engine.close()
    for other in states[1:]:
        assert other.equals(states[0])


@pytest.mark.parametrize("penalty", ["none", "l1"])
def test_lock_keeping_driver_calls_and_the_beta_mirror_change_no_bit(penalty):
    batches = _stream(30, [6000, 6000, 2500], "float32", seed=4)
    rng = np.random.default_rng(4)
    weights = [rng.uniform(0.5, 2.0, len(y)).astype("float32") for _, y in batches]
    config = HuberConfig(penalty=penalty, dtype="float32")
    states = []
    for hold in (True, False):
        engine = GpuEngine(config, hold_gil=hold)
        assert engine.holds_gil is hold
        for i, ((X, y), w) in enumerate(zip(batches, weights, strict=True)):
            engine.partial_fit(X, y, w if i == 1 else None)
            # β as the host reads it (the commit's mapped copy) is the state's β.
            assert engine.coefficients().tobytes() == engine.export_state().coefficients.tobytes()
        states.append(engine.export_state())
        # After an import the mirror holds the imported β until the next commit.
        engine.import_state(states[0].astype("float32"))
        assert engine.coefficients().tobytes() == states[0].coefficients.tobytes()
        engine.close()
    for other in states[1:]:
        assert other.equals(states[0])


def test_repeated_runs_are_bit_identical():
    batches = _stream(40, [20000, 20000], "float32", seed=9)
    config = HuberConfig(dtype="float32", penalty="l1")
    runs = []
    for _ in range(2):
        engine = GpuEngine(config)
        for X, y in batches:
            engine.partial_fit(X, y)
        runs.append(engine.export_state())
        engine.close()
    assert runs[0].equals(runs[1])


def test_dlpack_tensors_from_torch_are_used_without_copies():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    batches = _stream(10, [3000, 3000], "float64", seed=2)
    config = HuberConfig()
    a, b = GpuEngine(config), GpuEngine(config)
    for X, y in batches:
        a.partial_fit(torch.from_numpy(X).cuda(), torch.from_numpy(y).cuda())
        b.partial_fit(cp.asarray(X), cp.asarray(y))
    assert a.export_state().equals(b.export_state())
    out = a.predict(torch.from_numpy(batches[0][0]).cuda())
    assert isinstance(out, cp.ndarray)
    with pytest.raises(ValidationError, match="contiguous"):
        X = torch.from_numpy(batches[0][0]).cuda()
        a.partial_fit(X.t(), torch.from_numpy(batches[0][1][:10]).cuda())
    with pytest.raises(ValidationError, match="dtype"):
        X, y = batches[0]
        a.partial_fit(torch.from_numpy(X).cuda().float(), torch.from_numpy(y).cuda().float())


def test_bad_device_inputs_raise_clear_errors_and_leave_the_state_alone():
    X, y = _stream(5, [1000], "float64")[0]
    engine = GpuEngine(HuberConfig())
    engine.partial_fit(X, y)
    before = engine.export_state()
    Xd, yd = cp.asarray(X), cp.asarray(y)
    cases = [
        ((Xd.astype(cp.float32), yd.astype(cp.float32)), "dtype"),
        ((cp.asfortranarray(Xd), yd), "contiguous"),
        ((cp.asarray(np.column_stack([X, X]))[:, ::2], yd), "contiguous"),
        ((Xd, y), "on the host or all on the device"),
        ((cp.ascontiguousarray(Xd[:, :4]), yd), "features"),
        ((Xd, yd[:-1]), "shape"),
    ]
    for args, message in cases:
        with pytest.raises(ValidationError, match=message):
            engine.partial_fit(*args)
    bad = Xd.copy()
    bad[17, 3] = cp.nan
    with pytest.raises(ValidationError, match="finite"):
        engine.partial_fit(bad, yd)
    with pytest.raises(ValidationError, match="non-negative"):
        engine.partial_fit(Xd, yd, -cp.ones_like(yd))
    with pytest.raises(ValidationError, match="positive sum"):
        engine.partial_fit(Xd, yd, cp.zeros_like(yd))
    with pytest.raises(ValidationError, match="finite"):
        bad_host = X.copy()
        bad_host[3, 1] = np.inf
        engine.partial_fit(bad_host, y)
    assert engine.export_state().equals(before)
    # and the stream still continues exactly as an undisturbed one would
    engine.partial_fit(X, y)
    twin = GpuEngine(HuberConfig())
    twin.partial_fit(X, y)
    twin.partial_fit(X, y)
    assert engine.export_state().equals(twin.export_state())


def _correlated_batch(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Eight features with pairwise correlation 0.64: LAMM needs dozens of rounds from β = 0.

    (The NumPy reference takes 51 LAMM iterations on the first such batch.)
    """
    rng = np.random.default_rng(seed)
    common = rng.standard_normal((n, 1))
    X = 0.8 * common + 0.6 * rng.standard_normal((n, 8))
    y = X @ np.linspace(-2.0, 2.0, 8) + 5.0 + rng.standard_t(3, n)
    return X.astype(dtype), y.astype(dtype)


def _refused_batches(X, y):
    """Batches with one NaN, +inf or -inf (or a negative weight) in X, y or the weights.

    The bad value sits in the first or in the last row; X and y are also
    spoiled in weighted batches (whose Σw the host reads before the solve).
    Yields ``(X, y, w, message)``.
    """
    n = len(y)
    weights = np.linspace(0.5, 1.5, n).astype(X.dtype)
    for row in (0, n - 1):
        for value in (np.nan, np.inf, -np.inf):
            bad_x = X.copy()
            bad_x[row, X.shape[1] // 2] = value
            bad_y = y.copy()
            bad_y[row] = value
            bad_w = weights.copy()
            bad_w[row] = value
            yield bad_x, y, None, "finite"
            yield X, bad_y, None, "finite"
            yield bad_x, y, weights, "finite"
            yield X, bad_y, weights, "finite"
            yield X, y, bad_w, "non-negative"
        bad_w = weights.copy()
        bad_w[row] = -1.0
        yield X, y, bad_w, "non-negative"


def _assert_refusals_change_nothing(engine, X, y):
    """Every refused batch, device and host input, leaves state and β mirror bit-identical."""
    before = engine.export_state()
    mirror = engine._ws.beta_host.copy()
    count = 0
    for bad_x, bad_y, bad_w, message in _refused_batches(X, y):
        for to_device in (True, False):
            args = (bad_x, bad_y, bad_w)
            if to_device:
                args = tuple(None if a is None else cp.asarray(a) for a in args)
            with pytest.raises(ValidationError, match=message):
                engine.partial_fit(*args)
            after = engine.export_state()
            what = f"refusal {count} (device={to_device}, weighted={bad_w is not None})"
            assert after.equals(before), what
            assert after.previous_lambda == before.previous_lambda, what
            assert after.weight_sum == before.weight_sum, what
            assert engine._ws.beta_host.tobytes() == mirror.tobytes(), what
            assert engine.coefficients().tobytes() == before.coefficients.tobytes(), what
            count += 1
    assert count == 64


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_refused_batches_after_a_long_lamm_batch_change_nothing(dtype, graphs):
    """L1: the LAMM queue after a long batch must not commit a refused batch.

    The queue holds the previous batch's iteration count + 1 rounds of 8
    trials; on NaN data every trial fails, so a queue of 5 or more rounds
    reaches the contract's 40-trial stall, which ends the solve: the commit
    kernels must still leave β, J and the β mirror alone.
    """
    config = HuberConfig(penalty="l1", dtype=dtype)
    X0, y0 = _correlated_batch(3000, dtype, seed=3)
    X1, y1 = _correlated_batch(2000, dtype, seed=4)
    engine = GpuEngine(config, graphs=graphs)
    # Refused as the very first batch, the engine stays unfitted.
    bad = cp.asarray(y0)
    bad[-1] = cp.nan
    with pytest.raises(ValidationError, match="finite"):
        engine.partial_fit(cp.asarray(X0), bad)
    with pytest.raises(NotFittedError):
        engine.export_state()
    long = engine.partial_fit(cp.asarray(X0), cp.asarray(y0))
    assert long.converged
    assert long.iterations >= 20, f"the long batch took only {long.iterations} LAMM iterations"
    _assert_refusals_change_nothing(engine, X1, y1)
    follow = engine.partial_fit(cp.asarray(X1), cp.asarray(y1))
    twin = GpuEngine(config, graphs=graphs)
    twin.partial_fit(cp.asarray(X0), cp.asarray(y0))
    twin_follow = twin.partial_fit(cp.asarray(X1), cp.asarray(y1))
    assert engine.export_state().equals(twin.export_state())
    assert engine._ws.beta_host.tobytes() == twin._ws.beta_host.tobytes()
    assert follow == twin_follow
    assert engine.graph_error is None and engine.graphs is graphs
    engine.close()
    twin.close()


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("cholesky", ["kernel", "columns", "tiles", "cusolver"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_refused_batches_change_nothing_on_the_newton_paths(dtype, cholesky, graphs):
    """Unpenalised: the step graph's commit must not run for a refused batch.

    With one iteration allowed, the first step on a batch with an infinite y
    is accepted (its line-search sums are NaN), which ends the solve inside
    the very step graph whose status carries the validation flags.
    """
    X0, y0 = _correlated_batch(3000, dtype, seed=5)
    X1, y1 = _correlated_batch(2000, dtype, seed=6)
    for max_iter in (1, 100):
        config = HuberConfig(dtype=dtype, max_iter=max_iter)
        engine = GpuEngine(config, graphs=graphs, cholesky=cholesky)
        engine.partial_fit(cp.asarray(X0), cp.asarray(y0))
        _assert_refusals_change_nothing(engine, X1, y1)
        follow = engine.partial_fit(cp.asarray(X1), cp.asarray(y1))
        twin = GpuEngine(config, graphs=graphs, cholesky=cholesky)
        twin.partial_fit(cp.asarray(X0), cp.asarray(y0))
        twin_follow = twin.partial_fit(cp.asarray(X1), cp.asarray(y1))
        assert engine.export_state().equals(twin.export_state()), max_iter
        assert engine._ws.beta_host.tobytes() == twin._ws.beta_host.tobytes()
        assert follow == twin_follow
        assert engine._newton.small_solve == (cholesky != "cusolver")
        engine.close()
        twin.close()


def _capped_lamm_batch(n: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Twelve correlated features on scales 0.1 to 30, Student-t(1.5) noise.

    Poorly scaled columns and heavy tails: from β = 0 LAMM runs into the
    100-iteration cap on a 20,000-row batch (so does the NumPy reference),
    and the next batch's queue holds 101 rounds of 8 trials.
    """
    rng = np.random.default_rng(seed)
    scale = np.logspace(-1.0, 1.5, 12)
    common = rng.standard_normal((n, 1))
    X = (0.8 * common + 0.6 * rng.standard_normal((n, 12))) * scale
    y = X @ (np.linspace(-2.0, 2.0, 12) / scale) + 3.0 + rng.standard_t(1.5, n)
    return X.astype(dtype), y.astype(dtype)


def _state_bits(engine) -> dict:
    """Every field ``export_state()`` returns, as bytes, and the β host mirror."""
    state = engine.export_state()
    beta = state.coefficients.tobytes()
    assert engine.coefficients().tobytes() == beta, "coefficients() differs from the state's β"
    assert engine._ws.beta_host.tobytes() == beta, "the β mirror differs from the state's β"
    return {
        "beta": beta,
        "information": state.information.tobytes(),
        "dtypes": (state.coefficients.dtype, state.information.dtype),
        **state.counters(),
    }


def _bad_l1_batches(X, y):
    """``(name, X, y, w, message)``: one NaN or ±inf in X, y or the weights."""
    n = len(y)
    w = np.linspace(0.5, 1.5, n).astype(X.dtype)
    nan_x = X.copy()
    nan_x[n // 2, 3] = np.nan
    inf_y = y.copy()
    inf_y[-1] = np.inf
    neg_inf_y = y.copy()
    neg_inf_y[0] = -np.inf
    nan_w = w.copy()
    nan_w[7] = np.nan
    inf_w = w.copy()
    inf_w[-1] = np.inf
    yield "NaN in X", nan_x, y, None, "finite"
    yield "inf in y", X, inf_y, None, "finite"
    yield "-inf in y", X, neg_inf_y, None, "finite"
    yield "NaN in X, weighted", nan_x, y, w, "finite"
    yield "NaN in the weights", X, y, nan_w, "sample_weight must be finite"
    yield "inf in the weights", X, y, inf_w, "sample_weight must be finite"


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_l1_refusals_after_a_capped_lamm_batch_leave_every_field_bitwise(dtype, graphs):
    """L1 after a batch that ran LAMM into its cap: a refused batch changes no bit.

    Device (CuPy) and host (NumPy) input both reach the engine unscanned, as
    in a GPU Dask stream, so the device's validation flag alone stops them:
    β, J, every counter, λ, W, the β mirror and ``coefficients()`` stay as
    they were, through ``partial_fit`` and through ``partial_fit_stream``
    (whose prefetch of the next batch must not disturb it either), and the
    next good batch gives the bits of a stream that never saw the refusals.
    """
    config = HuberConfig(penalty="l1", dtype=dtype)
    X0, y0 = _capped_lamm_batch(500, dtype, seed=21)
    X1, y1 = _capped_lamm_batch(20000, dtype, seed=22)
    X2, y2 = _capped_lamm_batch(3000, dtype, seed=23)
    engine = GpuEngine(config, graphs=graphs)
    engine.partial_fit(cp.asarray(X0), cp.asarray(y0))
    long = engine.partial_fit(cp.asarray(X1), cp.asarray(y1))
    assert long.iterations >= 50, f"the long batch took only {long.iterations} LAMM iterations"
    before = _state_bits(engine)
    count = 0
    for name, bad_x, bad_y, bad_w, message in _bad_l1_batches(X2, y2):
        for device in (True, False):
            args = (bad_x, bad_y, bad_w)
            if device:
                args = tuple(None if a is None else cp.asarray(a) for a in args)
            with pytest.raises(ValidationError, match=message):
                engine.partial_fit(*args)
            assert _state_bits(engine) == before, f"{name} (device={device})"
            count += 1
    assert count == 12
    batches = engine.partial_fit_stream([(X2, y2 + np.asarray(np.nan, dtype)), (X2, y2)])
    with pytest.raises(ValidationError, match="finite"):
        next(batches)
    assert _state_bits(engine) == before, "partial_fit_stream"
    follow = engine.partial_fit(X2, y2)  # the copy partial_fit_stream prefetched
    twin = GpuEngine(config, graphs=graphs)
    twin.partial_fit(cp.asarray(X0), cp.asarray(y0))
    twin.partial_fit(cp.asarray(X1), cp.asarray(y1))
    twin_follow = twin.partial_fit(cp.asarray(X2), cp.asarray(y2))
    assert _state_bits(engine) == _state_bits(twin)
    assert follow == twin_follow
    assert engine.graph_error is None and engine.graphs is graphs
    engine.close()
    twin.close()


def test_other_device_is_refused():
    if _device_count() < 2:
        X, y = _stream(5, [100], "float64")[0]
        engine = GpuEngine(HuberConfig(), device="cuda:0")
        with pytest.raises(EngineUnavailableError, match="does not exist"):
            GpuEngine(HuberConfig(), device=f"cuda:{_device_count()}")
        with pytest.raises(EngineUnavailableError, match="CUDA device"):
            GpuEngine(HuberConfig(), device="cpu")
        engine.partial_fit(X, y)
        return
    X, y = _stream(5, [100], "float64")[0]
    engine = GpuEngine(HuberConfig(), device="cuda:0")
    with cp.cuda.Device(1):
        Xd, yd = cp.asarray(X), cp.asarray(y)
    with pytest.raises(ValidationError, match="cuda:1"):
        engine.partial_fit(Xd, yd)


def test_predict_returns_the_input_kind():
    batches = _stream(8, [2000], "float32")
    engine = GpuEngine(HuberConfig(dtype="float32"))
    engine.partial_fit(*batches[0])
    X = batches[0][0]
    host = engine.predict(X)
    dev = engine.predict(cp.asarray(X))
    assert isinstance(host, np.ndarray) and isinstance(dev, cp.ndarray)
    _assert_close(cp.asnumpy(dev), host, "float32", "prediction")


def test_checkpoint_continues_gpu_cpu_gpu(tmp_path):
    batches = _stream(7, [2000, 2000, 2000, 2000], "float64", seed=4)
    config = HuberConfig(penalty="l1")
    ref = NumpyEngine(config)
    for X, y in batches:
        ref.partial_fit(X, y)
    gpu = GpuEngine(config)
    for X, y in batches[:2]:
        gpu.partial_fit(X, y)
    cpu = NumpyEngine(config)
    cpu.import_state(gpu.export_state())
    cpu.partial_fit(*batches[2])
    gpu2 = GpuEngine(config)
    gpu2.import_state(cpu.export_state())
    gpu2.partial_fit(*batches[3])
    _assert_states_close(gpu2.export_state(), ref.export_state(), "float64", "engines")

    # the same through the estimator's checkpoints
    model = RenewableHuberRegressor(engine="gpu", penalty="l1")
    for X, y in batches[:2]:
        model.partial_fit(X, y)
    model.save(tmp_path / "a.npz")
    on_cpu = RenewableHuberRegressor.load(tmp_path / "a.npz", engine="numpy")
    on_cpu.partial_fit(*batches[2])
    on_cpu.save(tmp_path / "b.npz")
    back = RenewableHuberRegressor.load(tmp_path / "b.npz", engine="gpu")
    back.partial_fit(*batches[3])
    assert back.engine_ == "gpu"
    _assert_states_close(back.state_, ref.export_state(), "float64", "estimator")


def test_estimator_with_device_arrays_predicts_on_the_device():
    X, y = _stream(6, [3000], "float64")[0]
    model = RenewableHuberRegressor(engine="gpu", device="cuda:0")
    model.fit(cp.asarray(X), cp.asarray(y))
    out = model.predict(cp.asarray(X))
    assert isinstance(out, cp.ndarray)
    ref = RenewableHuberRegressor(engine="numpy").fit(X, y)
    _assert_close(model.coef_, ref.coef_, "float64", "coef_")
    _assert_close(cp.asnumpy(out), ref.predict(X), "float64", "predict")


def test_long_stream_reuses_device_memory():
    config = HuberConfig(dtype="float32")
    engine = GpuEngine(config)
    pool = cp.get_default_memory_pool()
    batches = _stream(24, [4096] * 6, "float32", seed=1)
    used = []
    for i in range(60):
        X, y = batches[i % len(batches)]
        if i % 2:
            engine.partial_fit(cp.asarray(X), cp.asarray(y))
        else:
            engine.partial_fit(X, y)
        cp.cuda.Device().synchronize()
        if i in (9, 59):
            used.append(pool.used_bytes())
    assert used[0] == used[1]
    assert engine.batch_count == 60


def test_strict_ieee_math_mode():
    engine = GpuEngine(HuberConfig(dtype="float32"))
    assert engine.cublas_math_mode == 0  # CUBLAS_DEFAULT_MATH: no TF32


@pytest.mark.parametrize("cholesky", ["kernel", "tiles", "cusolver"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_both_cholesky_paths_match_the_reference(cholesky, dtype):
    batches = _stream(90, [4096, 4096, 1500], dtype, seed=12)
    config = HuberConfig(dtype=dtype)
    ref = NumpyEngine(config)
    gpu = GpuEngine(config, cholesky=cholesky)
    noise = 0.0 if dtype == "float32" else None
    for i, (X, y) in enumerate(batches):
        d_ref = ref.partial_fit(X, y)
        d_gpu = gpu.partial_fit(X, y)
        s_gpu, s_ref = gpu.export_state(), ref.export_state()
        if noise is not None:
            noise = noise + _kappa_noise(
                config, X, y, None, s_gpu.coefficients, s_ref.coefficients, d_ref.bandwidth
            )
        _assert_states_close(s_gpu, s_ref, dtype, f"batch {i}", noise)
        assert d_gpu.converged == d_ref.converged
    assert gpu._newton.small_solve == (cholesky != "cusolver")


def test_pinned_pool_copies_reuses_and_feeds_the_engine_bit_identically():
    import gc

    from gpu_engine.transfer import is_pinned

    batches = _stream(30, [6000, 6000, 2500, 6000], "float32", seed=21)
    weights = [
        np.random.default_rng(i).uniform(0.5, 2.0, len(y)).astype("float32")
        for i, (_, y) in enumerate(batches)
    ]
    config = HuberConfig(dtype="float32")
    plain = GpuEngine(config)
    for (X, y), w in zip(batches, weights, strict=True):
        plain.partial_fit(X, y, w)
    pinned_engine = GpuEngine(config)
    pool = pinned_engine.pinned_pool
    copies = []
    for (X, y), w in zip(batches, weights, strict=True):
        Xp, yp, wp = pool.copy_batch(X, y, w)
        assert all(is_pinned(cp, a) for a in (Xp, yp, wp))
        np.testing.assert_array_equal(Xp, X)
        np.testing.assert_array_equal(yp, y)
        np.testing.assert_array_equal(wp, w)
        copies.append((Xp, yp, wp))
    assert pool.buffers == len(batches)
    for diag in pinned_engine.partial_fit_stream(copies):
        assert diag.converged
    assert pinned_engine.export_state().equals(plain.export_state())
    # Buffers return once no array views them (the engine keeps the last two
    # staged batches until their slots are reused) and are then reused.
    copies.clear()
    gc.collect()
    held = pool.buffers
    X, y = batches[0]
    again = pool.copy_batch(X, y, None)
    assert pool.buffers == held
    with pytest.raises(ValidationError, match="float32"):
        pool.copy_batch(X.astype("float64"), y, None)
    del again
    pinned_engine.close()
    plain.close()


def test_distributed_fit_on_a_cuda_cluster_with_each_loader(tmp_path, monkeypatch):
    dask_cuda = pytest.importorskip("dask_cuda", reason="needs dask-cuda")
    da = pytest.importorskip("dask.array")
    from distributed import Client

    spec = StreamSpec(n_features=12, seed=3)
    X, y = spec.chunk(0, 40_000, "float32")
    ref = RenewableHuberRegressor(engine="gpu", dtype="float32")
    for start in range(0, 40_000, 5_000):
        ref.partial_fit(X[start : start + 5_000], y[start : start + 5_000])
    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1, threads_per_worker=4, resources={"GPU": 1}, dashboard_address=":0"
        ) as cluster,
        Client(cluster),
    ):
        for loader in ("actor", "engine-worker"):
            model = RenewableHuberRegressor(
                engine="gpu", dtype="float32", loader=loader, progress=False
            )
            model.fit(da.from_array(X, chunks=(5_000, 12)), da.from_array(y, chunks=5_000))
            assert model.placement_["loader"] == loader
            np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)
            np.testing.assert_array_equal(model.coef_history_, ref.coef_history_)
        # Memory-mapped chunks are pinned whatever their size (only they, with
        # the size rule off), and a refit takes the engine parked by the last.
        import dask.config

        pinning = dask.config.config["rh-dask"]["distributed"]
        monkeypatch.setitem(pinning, "pin-max-bytes", 0)  # restored after the test
        da.to_npy_stack(tmp_path / "X", da.from_array(X, chunks=(5_000, 12)))
        da.to_npy_stack(tmp_path / "y", da.from_array(y, chunks=5_000))
        Xm, ym = da.from_npy_stack(tmp_path / "X"), da.from_npy_stack(tmp_path / "y")
        for _ in range(2):
            model = RenewableHuberRegressor(engine="gpu", dtype="float32", progress=False)
            model.fit(Xm, ym)
            assert model.placement_["engine_reused"]
            np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)
        # A NaN mid-stream is refused by the device check, naming the chunk.
        X_bad = X.copy()
        X_bad[17_000, 3] = np.nan
        model = RenewableHuberRegressor(engine="gpu", dtype="float32", progress=False)
        from rh_dask.exceptions import StreamError

        with pytest.raises(StreamError, match=r"chunk 3 was refused.*finite"):
            model.fit(da.from_array(X_bad, chunks=(5_000, 12)), da.from_array(y, chunks=5_000))
        assert model.state_.batch_count == 3


def test_relayed_fit_on_a_gpu_worker_equals_the_loop(tmp_path):
    """loader="relay": loads on a CPU worker, two relays write into the GPU worker's ring."""
    da = pytest.importorskip("dask.array")
    import dask.config
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from rh_dask.exceptions import StreamError

    spec = StreamSpec(n_features=12, seed=5)
    X, y = spec.chunk(0, 60_000, "float32")
    ref = RenewableHuberRegressor(engine="gpu", dtype="float32")
    for start in range(0, 60_000, 5_000):
        ref.partial_fit(X[start : start + 5_000], y[start : start + 5_000])
    relay = {"cls": Nanny, "options": {"nthreads": 1, "resources": {"relay": 1}}}
    workers = {
        "gpu": {"cls": Nanny, "options": {"nthreads": 2, "resources": {"GPU": 1}}},
        "relay-0": relay,
        "relay-1": relay,
        "loader": {"cls": Nanny, "options": {"nthreads": 2}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with (
        dask.config.set({"rh-dask.relay.directory": str(tmp_path)}),
        SpecCluster(workers=workers, scheduler=scheduler) as cluster,
        Client(cluster, direct_to_workers=True) as client,
    ):
        client.wait_for_workers(4)
        Xd, yd = da.from_array(X, chunks=(5_000, 12)), da.from_array(y, chunks=5_000)
        for loader in ("relay", "auto"):
            model = RenewableHuberRegressor(
                engine="gpu", dtype="float32", loader=loader, progress=False
            )
            model.fit(Xd, yd)
            assert model.placement_["loader"] == "relay"
            assert len(model.placement_["relays"]) == 2
            # The second fit takes the ring (page-locked) kept with the parked engine.
            assert model.placement_["relay_ring_reused"] is (loader == "auto")
            np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)
            np.testing.assert_array_equal(model.coef_history_, ref.coef_history_)
        # The device's finiteness check refuses a relayed chunk, naming it.
        X_bad = X.copy()
        X_bad[27_000, 3] = np.nan
        model = RenewableHuberRegressor(engine="gpu", dtype="float32", loader="relay")
        with pytest.raises(StreamError, match=r"chunk 5 was refused.*finite"):
            model.set_params(progress=False).fit(da.from_array(X_bad, chunks=(5_000, 12)), yd)
        assert model.state_.batch_count == 5
        # Chunks of .npy files go from the loader's page cache with sendfile; the
        # relay leaves the finiteness check to the device, which refuses chunk 5.
        import rh_dask

        for name, a in (("X", X), ("y", y), ("X_bad", X_bad)):
            np.save(tmp_path / f"{name}.npy", a)
        yf = rh_dask.read_npy(tmp_path / "y.npy", chunk_rows=5_000)
        model = RenewableHuberRegressor(engine="gpu", dtype="float32", loader="relay")
        model.set_params(progress=False).fit(
            rh_dask.read_npy(tmp_path / "X.npy", chunk_rows=5_000), yf
        )
        assert model.placement_["relay_sendfile"] is True
        np.testing.assert_array_equal(model.state_.coefficients, ref.state_.coefficients)
        np.testing.assert_array_equal(model.coef_history_, ref.coef_history_)
        model = RenewableHuberRegressor(engine="gpu", dtype="float32", loader="relay")
        with pytest.raises(StreamError, match=r"chunk 5 was refused.*finite"):
            model.set_params(progress=False).fit(
                rh_dask.read_npy(tmp_path / "X_bad.npy", chunk_rows=5_000), yf
            )
        assert model.state_.batch_count == 5 and model.placement_["relay_sendfile"] is True
        from rh_dask.distributed import release_engines

        release_engines(client)  # closes the parked engines and the rings kept with them
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("rh-dask-ring")]


def test_pinned_pool_without_waiting_grows_in_the_background():
    import time

    engine = GpuEngine(HuberConfig(dtype="float32"))
    pool = engine.pinned_pool
    X, y = _stream(8, [3000], "float32")[0]
    assert pool.copy_batch(X, y, None, wait=False) is None  # nothing idle yet
    deadline = time.monotonic() + 10
    while pool.buffers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    copied = pool.copy_batch(X, y, None, wait=False)
    assert copied is not None
    np.testing.assert_array_equal(copied[0], X)
    engine.close()


def test_host_batches_are_not_kept_alive_by_the_engine():
    import weakref

    engine = GpuEngine(HuberConfig(dtype="float32"))
    X, y = _stream(8, [2000], "float32")[0]
    X, y = X.copy(), y.copy()
    refs = (weakref.ref(X), weakref.ref(y))
    engine.partial_fit(X, y)
    del X, y
    assert all(r() is None for r in refs)
    engine.close()


# -- the score variance K (the sandwich's meat) ------------------------------------------


def _assert_meat_close(actual, expected, dtype, what):
    """K within the contract's tolerance on the scale of its entries, √(K_aa K_bb).

    K's off-diagonal entries are sums of terms of both signs, so a relative
    bound on the entry itself is meaningless where they cancel; Cauchy-Schwarz
    bounds every entry by that scale, on which both engines' rounding acts.
    """
    rtol, atol = TOL[np.dtype(dtype).name]
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = np.sqrt(np.outer(np.diag(expected), np.diag(expected)))
    diff = np.abs(actual - expected)
    assert np.all(diff <= atol + rtol * scale), (
        f"{what}: worst |diff|/bound {np.max(diff / (atol + rtol * scale)):.3g}"
    )


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("penalty", ["none", "l1"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_score_variance_matches_the_reference_batch_by_batch(dtype, penalty, weighted):
    batches = _stream(12, [6000, 6000, 2500], dtype, seed=11)
    rng = np.random.default_rng(3)
    config = HuberConfig(penalty=penalty, dtype=dtype)
    ref, gpu = NumpyEngine(config), GpuEngine(config)
    for i, (X, y) in enumerate(batches):
        w = rng.uniform(0.2, 2.0, len(y)).astype(dtype) if weighted else None
        ref.partial_fit(X, y, w)
        gpu.partial_fit(X, y, w)
        s_gpu, s_ref = gpu.export_state(), ref.export_state()
        if penalty == "l1":  # no inference for L1, so neither engine keeps K
            assert s_gpu.score_variance is None and s_ref.score_variance is None
            continue
        assert s_gpu.score_variance is not None and s_gpu.score_variance.dtype == np.dtype(dtype)
        _assert_meat_close(s_gpu.score_variance, s_ref.score_variance, dtype, f"batch {i}")
    gpu.close()


def test_score_variance_off_absent_after_an_old_state_and_carried_through_imports():
    batches = _stream(5, [3000, 3000, 3000], "float64", seed=5)
    config = HuberConfig()
    off = GpuEngine(config, score_variance=False)
    off.partial_fit(*batches[0])
    assert off.export_state().score_variance is None
    with pytest.raises(ValidationError, match="score_variance"):
        GpuEngine(config, score_variance=1)

    ref = NumpyEngine(config)
    for X, y in batches:
        ref.partial_fit(X, y)
    # K travels through import: NumPy → GPU → continue equals the NumPy stream.
    cpu = NumpyEngine(config)
    cpu.partial_fit(*batches[0])
    gpu = GpuEngine(config)
    gpu.import_state(cpu.export_state())
    gpu.partial_fit(*batches[1])
    gpu.partial_fit(*batches[2])
    _assert_meat_close(
        gpu.export_state().score_variance, ref.export_state().score_variance, "float64", "import"
    )
    # A state without K continues without it, until reset starts a fresh stream.
    old = cpu.export_state()
    old.score_variance = None
    gpu.import_state(old)
    gpu.partial_fit(*batches[1])
    assert gpu.export_state().score_variance is None
    gpu.reset()
    gpu.partial_fit(*batches[0])
    _assert_meat_close(
        gpu.export_state().score_variance, cpu.export_state().score_variance, "float64", "reset"
    )
    # A refused batch leaves K exactly as it was.
    before = gpu.export_state().score_variance.copy()
    bad_X, bad_y = batches[1][0].copy(), batches[1][1]
    bad_X[7, 2] = np.nan
    with pytest.raises(ValidationError):
        gpu.partial_fit(bad_X, bad_y)
    np.testing.assert_array_equal(gpu.export_state().score_variance, before)
    # An L1 stream continuing a state with K drops it, as the NumPy engine does.
    lasso = GpuEngine(HuberConfig(penalty="l1"))
    lasso.import_state(cpu.export_state())
    lasso.partial_fit(*batches[1])
    assert lasso.export_state().score_variance is None
    for engine in (off, gpu, lasso):
        engine.close()


def test_gpu_fit_gives_standard_errors_like_the_numpy_engine():
    X, y = _stream(6, [20000], "float64", seed=9)[0]
    cpu = RenewableHuberRegressor(engine="numpy").fit(X, y)
    gpu = RenewableHuberRegressor(engine="gpu").fit(X, y)
    np.testing.assert_allclose(gpu.bse_, cpu.bse_, rtol=1e-7)
    table = gpu.summary().table
    assert list(table.index)[-1] == "intercept" and np.isfinite(table.values).all()


# -- robust per-batch diagnostics ------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_robust_diagnostics_match_the_reference(dtype, weighted):
    batches = _stream(8, [5000, 5000, 3001], dtype, seed=13)
    rng = np.random.default_rng(4)
    config = HuberConfig(dtype=dtype)
    ref, gpu = NumpyEngine(config), GpuEngine(config, diagnostics=True)
    # The engines' β differ within the contract's tolerance, and r with them.
    rtol = 1e-6 if dtype == "float64" else 5e-3
    for X, y in batches:
        w = None
        if weighted:
            w = rng.integers(0, 4, len(y)).astype(dtype)  # zero weights take no part
            w[0] = 1
        d_ref, d_gpu = ref.partial_fit(X, y, w), gpu.partial_fit(X, y, w)
        assert d_gpu.mean_loss == pytest.approx(d_ref.mean_loss, rel=rtol)
        # Rows within rounding of |r| = τ may fall either side: a row or two.
        assert abs(d_gpu.outlier_share - d_ref.outlier_share) <= 2.0 / len(y)
        assert d_gpu.residual_scale == pytest.approx(d_ref.residual_scale, rel=rtol)
    gpu.close()
    off = GpuEngine(config, diagnostics=False)
    d = off.partial_fit(*batches[0])
    assert d.mean_loss is None and d.outlier_share is None and d.residual_scale is None
    off.close()
