"""The Dask graph adapter (rh_dask.distributed.graphs): each fast path and its fallback.

The fallbacks stand in for Dask calls a release may lack; each test forces
one and checks that it gives what the fast path gives.
"""

from __future__ import annotations

import ast
import operator
from pathlib import Path

import dask
import dask.array as da
import dask.dataframe as dd
import dask.order
import numpy as np
import pandas as pd
import pytest
from dask.task_spec import DataNode, Task, TaskRef

from rh_dask import RenewableHuberRegressor
from rh_dask.distributed import graphs
from rh_dask.distributed.chunks import ChunkGraph, align_stream
from rh_dask.distributed.loading import assemble_chunk

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_collections_to_expr(monkeypatch):
    monkeypatch.setattr(graphs, "_collections_to_expr", None)


@pytest.fixture
def no_graphnode_fuse(monkeypatch):
    monkeypatch.setattr(graphs, "_graphnode_fuse", None)


def _private_dask_uses(path: Path) -> list[str]:
    """Imports of ``dask._*``/``distributed._*`` modules and ``dask._x`` attributes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        for name in names:
            parts = name.split(".")
            if parts[0] in ("dask", "distributed") and any(p.startswith("_") for p in parts):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                found.append(f"{where}:{node.lineno}: {name}")
    return found


def test_no_private_dask_imports_in_the_package_tests_or_benchmarks():
    files = [
        p
        for folder in ("rh_dask", "gpu_engine", "tests", "benchmarks")
        for p in sorted((ROOT / folder).rglob("*.py"))
    ]
    assert len(files) > 20
    uses = [use for path in files for use in _private_dask_uses(path)]
    assert uses == []


def test_the_private_use_check_sees_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import dask._task_spec\nfrom dask._task_spec import Task\n"
        "from distributed._concurrent_futures_thread import x\nimport dask\ny = dask._expr\n"
        "from dask.task_spec import TaskRef\n"
    )
    assert [u.split(": ")[1] for u in _private_dask_uses(probe)] == [
        "dask._task_spec",
        "dask._task_spec",
        "dask._task_spec.Task",
        "distributed._concurrent_futures_thread",
        "distributed._concurrent_futures_thread.x",
        "dask._expr",
    ]


# -- compute_keys -------------------------------------------------------------------------
def _record(calls):
    def f(name, *args):
        calls.append(name)
        return (name, *args)

    return f


def test_compute_keys_never_orders_a_task_graph(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("dask.order was called")

    monkeypatch.setattr(dask.order, "order", refuse)
    calls: list[str] = []
    f = _record(calls)
    dsk = {
        "a": Task("a", f, "A"),
        "b": Task("b", f, "B", TaskRef("a")),
        "c": Task("c", f, "C", TaskRef("a"), TaskRef("b")),
        "x": DataNode("x", 7),
        "d": Task("d", f, "D", TaskRef("c"), TaskRef("x")),
    }
    assert graphs.compute_keys(dsk, ["d"]) == [("D", ("C", ("A",), ("B", ("A",))), 7)]
    assert calls == ["A", "B", "C", "D"]


def test_compute_keys_hands_legacy_tuple_tasks_to_dask_get(monkeypatch):
    seen = []
    real_get = dask.get

    def spy(dsk, keys, **kwargs):
        seen.append(sorted(map(str, dsk)))
        return real_get(dsk, keys, **kwargs)

    monkeypatch.setattr(dask, "get", spy)
    # one legacy task among new-style nodes: the whole graph goes to dask.get
    dsk = {
        "a": DataNode("a", 2),
        "b": (operator.mul, "a", 10),
        "c": Task("c", operator.add, TaskRef("b"), 1),
    }
    assert graphs.compute_keys(dsk, ["c", "b"]) == [21, 20]
    assert seen == [["a", "b", "c"]]
    seen.clear()
    assert graphs.compute_keys({"a": DataNode("a", 2)}, ["a"]) == [2]
    assert seen == []


# -- optimized_graph ----------------------------------------------------------------------
def _values(graph, keys):
    return graphs.compute_keys(dict(graph), keys)


def _flat(keys):
    out = []
    for k in keys:
        while isinstance(k, list):
            k = k[0]
        out.append(k)
    return out


def test_optimized_graph_fallback_gives_the_same_keys_and_values(monkeypatch):
    rng = np.random.default_rng(0)
    X = da.from_array(rng.normal(size=(40, 3)), chunks=(10, 3))
    y = (X[:, 0] - X[:, 0].mean()) * 2  # shares X's chunks and a global mean
    fast_graph, fast_keys = graphs.optimized_graph([X, y])
    monkeypatch.setattr(graphs, "_collections_to_expr", None)
    slow_graph, slow_keys = graphs.optimized_graph([X, y])
    assert slow_keys == fast_keys and len(fast_keys) == 2
    for keys in fast_keys:
        flat = _flat(keys)
        for a, b in zip(_values(fast_graph, flat), _values(slow_graph, flat), strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        np.concatenate(_values(slow_graph, _flat(slow_keys[1]))), y.compute()
    )


def test_optimized_graph_fallback_on_a_dataframe(no_collections_to_expr):
    frame = pd.DataFrame({"a": np.arange(12.0), "b": np.arange(12.0) ** 2, "t": np.ones(12)})
    ddf = dd.from_pandas(frame, npartitions=3)
    graph, keys = graphs.optimized_graph([ddf[["a", "b"]], ddf["t"]])
    assert [len(k) for k in keys] == [3, 3]
    pd.testing.assert_frame_equal(pd.concat(_values(graph, keys[0])), frame[["a", "b"]])
    pd.testing.assert_series_equal(pd.concat(_values(graph, keys[1])), frame["t"])


def test_chunk_graph_is_the_same_plan_through_the_fallback(monkeypatch):
    rng = np.random.default_rng(1)
    X = da.from_array(rng.normal(size=(60, 4)), chunks=(15, 4))
    y = X.sum(axis=1) - X.sum(axis=1).mean()  # a global mean: shared keys
    stream = align_stream(X, y, None)

    def plan():
        graph = ChunkGraph(stream, assemble_chunk, lambda i: stream.spec(i, "float64", False))
        return [
            (len(graph.subgraph(i)), len(graph.shared_owned(i)), len(graph.shared_needed(i)))
            for i in range(graph.n_chunks)
        ]

    fast = plan()
    monkeypatch.setattr(graphs, "_collections_to_expr", None)
    assert plan() == fast
    assert len(fast) == 4 and any(owned for _, owned, _ in fast)


def test_parquet_partitions_stay_the_batches_through_the_fallback(
    tmp_path, no_collections_to_expr
):
    rng = np.random.default_rng(2)
    columns = [f"c{i}" for i in range(19)] + ["target"]
    for i in range(4):
        frame = pd.DataFrame(rng.normal(size=(300, 20)), columns=columns)
        frame.to_parquet(tmp_path / f"part{i}.parquet")
    ddf = dd.read_parquet(tmp_path)
    with dask.config.set(scheduler="sync"):
        model = RenewableHuberRegressor(progress=False).fit(ddf[["c0", "c1"]], ddf["target"])
    assert model.history_["rows"].tolist() == [300] * 4


# -- fuse ---------------------------------------------------------------------------------
def _chain():
    return [
        Task("a", operator.add, TaskRef("outside"), 1),
        Task("b", operator.mul, TaskRef("a"), 3),
        Task("c", operator.sub, TaskRef("b"), TaskRef("outside")),
    ]


@pytest.mark.parametrize("builder", ["fuse", "fused_task"])
def test_fused_task_reads_only_outside_keys_and_computes_the_output(builder):
    fused = getattr(graphs, builder)(_chain(), "out")
    assert fused.key == "out"
    assert set(fused.dependencies) == {"outside"}
    dsk = {"outside": DataNode("outside", 5), "out": fused}
    assert graphs.compute_keys(dsk, ["out"]) == [(5 + 1) * 3 - 5]
    assert dask.get(dsk, "out") == 13


def test_fuse_falls_back_to_the_own_task(no_graphnode_fuse):
    fused = graphs.fuse(_chain(), "out")
    assert fused.func is graphs._run_fused
    assert graphs.compute_keys({"outside": DataNode("outside", 1), "out": fused}, ["out"]) == [5]


def test_fused_task_refuses_two_outputs():
    tasks = [Task("a", operator.neg, 1), Task("b", operator.neg, 2)]
    with pytest.raises(ValueError, match="2 outputs"):
        graphs.fused_task(tasks, "out")


# -- whole fits through the fallbacks ---------------------------------------------------------
def _stream(seed=3):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(2_000, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.3 + rng.standard_t(2, size=2_000)
    Xd = da.from_array(X, chunks=(400, 4))
    return Xd - Xd.mean(axis=0), da.from_array(y, chunks=400)


def _fit(**params):
    X, y = _stream()
    with dask.config.set(scheduler="sync"):
        return RenewableHuberRegressor(progress=False, **params).fit(X, y)


def test_single_process_fit_is_the_same_through_the_fallbacks(monkeypatch):
    fast = _fit()
    monkeypatch.setattr(graphs, "_collections_to_expr", None)
    monkeypatch.setattr(graphs, "_graphnode_fuse", None)
    slow = _fit()
    np.testing.assert_array_equal(slow.coef_, fast.coef_)
    assert slow.intercept_ == fast.intercept_
    assert len(slow.history_) == len(fast.history_) == 5


@pytest.mark.timeout(120)
def test_cluster_fit_submits_own_fused_tasks_with_the_same_result():
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0"
        ) as lc,
        Client(lc, set_as_default=False) as client,
        client.as_current(),
    ):
        X, y = _stream()
        fast = RenewableHuberRegressor(progress=False, loader="cluster", lookahead=2).fit(X, y)
        built = []
        fused_task = graphs.fused_task

        def counted(tasks, key):
            built.append(key)
            return fused_task(tasks, key)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(graphs, "_graphnode_fuse", None)
            mp.setattr(graphs, "fused_task", counted)
            slow = RenewableHuberRegressor(progress=False, loader="cluster", lookahead=2).fit(X, y)
    assert len(built) >= 3  # every chunk but the one holding the shared mean is fused
    np.testing.assert_array_equal(fast.coef_, slow.coef_)
    assert fast.intercept_ == slow.intercept_
