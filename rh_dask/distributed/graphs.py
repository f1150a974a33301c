"""The Dask task-graph interfaces rh-dask builds on, in one place.

The rest of the package takes its task-graph names and graph operations from
this module, so that a change in Dask touches only this file. What each call
is, and what takes its place where a Dask release lacks it:

* ``dask.task_spec`` (``DataNode``, ``GraphNode``, ``List``, ``Task``,
  ``TaskRef``; a node's ``dependencies``, calling a node with its inputs):
  a public module. Required.
* ``dask.optimize``, ``DataFrame.optimize``, ``dask.get``,
  ``dask.core.get_dependencies`` and the collection protocol
  (``__dask_graph__``, ``__dask_keys__``): public and documented. Required.
* ``dask.base.collections_to_expr`` with the ``optimize``,
  ``__dask_graph__`` and ``__dask_keys__`` of the expression it returns: a
  public name that Dask describes as internal (the expression is an object
  of the private ``dask._expr``). Without it: each collection optimised
  on its own (a DataFrame's ``optimize`` method, else ``dask.optimize``),
  then its graph and keys (:func:`optimized_graph`).
* ``Task.func``, ``Task.args``, ``Task.kwargs``: attributes of a public
  class, not in Dask's documentation. Without them: no task is seen as a
  bare call (:func:`bare_call`), and every chunk loads as a task.
* ``GraphNode.fuse``: a public method, not in Dask's documentation. Without
  it: one :class:`Task` of our own that runs the tasks in dependency order
  (:func:`fused_task`).

No private Dask module is imported. Legacy tuple tasks (Dask's older graph
format, which optimised collections never hold) are computed by Dask's own
synchronous scheduler, ``dask.get``, rather than converted to ``GraphNode``
objects, which only a private function of Dask does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dask
import dask.dataframe as dd
from dask.core import get_dependencies
from dask.task_spec import DataNode, GraphNode, List, Task, TaskRef

try:
    from dask.base import collections_to_expr as _collections_to_expr
except ImportError:  # a Dask without it: dask.optimize does the same job
    _collections_to_expr = None

#: ``GraphNode.fuse`` where this Dask has it (``None``: :func:`fuse` builds the task).
_graphnode_fuse = getattr(GraphNode, "fuse", None)

__all__ = [
    "DataNode",
    "GraphNode",
    "List",
    "Task",
    "TaskRef",
    "bare_call",
    "compute_keys",
    "dependencies",
    "fuse",
    "optimized_graph",
]

Key = Any


def optimized_graph(collections: Sequence[Any]) -> tuple[dict[Key, Any], list[Any]]:
    """The optimised graph of several collections together, and each one's keys.

    Parameters
    ----------
    collections : sequence of Dask collections
        Optimised together, as ``dask.compute`` would: shared inputs appear
        once in the graph.

    Returns
    -------
    graph : dict
        Key → task for everything the collections need.
    keys : list
        ``__dask_keys__()`` of each collection, in the order given.
    """
    if _collections_to_expr is not None:
        expr = _collections_to_expr(list(collections), optimize_graph=True).optimize()
        return dict(expr.__dask_graph__()), list(expr.__dask_keys__())
    optimised = [_optimised(collection) for collection in collections]
    graph: dict[Key, Any] = {}
    for collection in optimised:
        graph.update(collection.__dask_graph__())
    return graph, [collection.__dask_keys__() for collection in optimised]


def _optimised(collection: Any) -> Any:
    """``collection`` with its graph optimised, through documented calls only.

    One collection at a time: ``dask.optimize`` of a DataFrame projection
    returns the unprojected frame (Dask 2025.12.0 to 2026.8.0), so DataFrames
    and Series use their own ``optimize`` method. Inputs shared by several
    collections keep their keys, so merging the graphs computes them once.
    """
    if isinstance(collection, (dd.DataFrame, dd.Series)):
        return collection.optimize()
    (out,) = dask.optimize(collection, traverse=False)
    return out


def dependencies(graph: dict[Key, Any], key: Key) -> Any:
    """The keys the task ``graph[key]`` reads (a legacy tuple task's too)."""
    node = graph[key]
    if isinstance(node, GraphNode):
        return node.dependencies
    return get_dependencies(graph, key)


def bare_call(node: Any) -> Any | None:
    """The callable of a task that calls it with no arguments, else ``None``.

    Such a task's result is wholly described by the callable (the chunk
    tasks of :func:`rh_dask.read_npy` are these), so a caller may act on the
    callable instead of running the task.
    """
    if not isinstance(node, Task) or node.dependencies:
        return None
    func = getattr(node, "func", None)
    if func is None or getattr(node, "args", None) != () or getattr(node, "kwargs", None) != {}:
        return None
    return func


def fuse(tasks: Sequence[GraphNode], key: Key) -> GraphNode:
    """One task under ``key`` that runs ``tasks`` (a subgraph with one output).

    Its dependencies are the keys the tasks read from outside the subgraph.

    Raises
    ------
    ValueError
        When the tasks have more than one output (a key no other task reads).
    """
    if _graphnode_fuse is not None:
        return _graphnode_fuse(*tasks, key=key)
    return fused_task(tasks, key)


def fused_task(tasks: Sequence[GraphNode], key: Key) -> Task:
    """:func:`fuse` from public names only: a task running :func:`compute_keys`.

    Raises
    ------
    ValueError
        When the tasks have more than one output.
    """
    inner = {task.key: task for task in tasks}
    read: set[Key] = set()
    for task in tasks:
        read.update(task.dependencies)
    outputs = inner.keys() - read
    if len(outputs) != 1:
        raise ValueError(f"cannot fuse tasks with {len(outputs)} outputs into one task")
    (output,) = outputs
    external = tuple(sorted(read - inner.keys(), key=str))
    return Task(key, _run_fused, inner, output, external, *(TaskRef(k) for k in external))


def _run_fused(
    inner: dict[Key, GraphNode], output: Key, external: tuple[Key, ...], *values: Any
) -> Any:
    dsk = dict(inner)
    for k, value in zip(external, values, strict=True):
        dsk[k] = DataNode(k, value)
    return compute_keys(dsk, [output])[0]


def compute_keys(dsk: dict[Key, Any], keys: list[Key]) -> list[Any]:
    """The values of ``keys`` in the small graph of one chunk, on this thread.

    Each task runs once, after its dependencies, and an intermediate value
    is dropped once its last user has run. Dask's synchronous scheduler
    would do the same but first orders the graph (``dask.order``), which
    costs a loading thread up to two thirds of its share of the interpreter
    lock (H200, 65,536-row chunks; docs/performance.md), for graphs of a
    handful of tasks that any order computes alike.

    A graph holding legacy tuple tasks goes to ``dask.get`` (Dask's
    synchronous scheduler) as it is: only Dask's private API converts such
    tasks, and the graphs of optimised collections hold none.
    """
    if not all(isinstance(node, GraphNode) for node in dsk.values()):
        return list(dask.get(dsk, keys))
    # Dependency-first order from the requested keys (iterative: no recursion limit).
    order: list[Key] = []
    seen: set[Key] = set()
    for root in keys:
        stack: list[tuple[Key, bool]] = [(root, False)]
        while stack:
            key, expanded = stack.pop()
            if expanded:
                order.append(key)
                continue
            if key in seen:
                continue
            seen.add(key)
            stack.append((key, True))
            stack.extend((dep, False) for dep in dsk[key].dependencies if dep not in seen)
    users: dict[Key, int] = dict.fromkeys(order, 0)
    for key in order:
        for dep in dsk[key].dependencies:
            users[dep] += 1
    wanted = set(keys)
    cache: dict[Key, Any] = {}
    for key in order:
        node = dsk[key]
        cache[key] = node(cache)
        for dep in node.dependencies:
            users[dep] -= 1
            if users[dep] == 0 and dep not in wanted:
                del cache[dep]
    return [cache[key] for key in keys]
