"""A JSON fingerprint of a Dask stream's input, to tell whether a checkpoint belongs to it.

A walk checkpoint records the fingerprint of the input it read; resuming it
on another input would silently mix two datasets, so :func:`check_fingerprint`
refuses it. The fingerprint holds the chunk structure (number of chunks,
known row counts, width, which inputs are separate collections, the target
and weight columns) and a *token* of the collections' content: a Dask token
computed with ``tokenize.ensure-deterministic``, over

* a DataFrame's expression tree, its operands included (the data of a
  ``from_pandas`` frame, a Parquet reader's paths, options and the files'
  checksums, which change when a file is rewritten), leaving out the readers'
  caches, which are not the same in two processes;
* an array's task graph (the data of a ``from_array`` source, every function
  and argument of its tasks).

The token is ``None`` when some part cannot be tokenized deterministically
(a function or object Dask can only hash by identity); the other fields are
then all that is compared.
"""

from __future__ import annotations

import math
from typing import Any

import dask
import dask.array as da
from dask.base import tokenize

from ..exceptions import CheckpointError
from .chunks import AlignedStream

__all__ = ["check_fingerprint", "fingerprint"]

#: Expression operands that cache what a reader found (dataset metadata,
#: length statistics): not the data, and not equal between processes.
_CACHE_OPERANDS = frozenset({"_dataset_info_cache", "_pq_length_stats"})
#: Fields compared, in the order a mismatch is reported (the token last).
_FIELDS = (
    "n_chunks",
    "n_features",
    "roles",
    "target",
    "weight",
    "weight_value",
    "feature_names",
    "rows",
)


def fingerprint(aligned: AlignedStream) -> dict[str, Any]:
    """The fingerprint of an aligned stream: a dict of JSON values.

    Parameters
    ----------
    aligned : AlignedStream
        The stream's inputs, as :func:`rh_dask.distributed.chunks.align_stream` aligned them.

    Returns
    -------
    dict
        ``token`` (str or ``None``), ``n_chunks`` (int), ``rows`` (a list,
        one row count per chunk, ``None`` where unknown, as for DataFrame
        partitions), ``n_features`` (int or ``None``), ``roles`` (list of
        ``"X"``, ``"y"``, ``"w"``), ``target`` and ``weight`` (column names or
        ``None``), ``weight_value`` (a scalar weight or ``None``) and
        ``feature_names`` (list or ``None``).
    """
    weight_value = aligned.weight_value
    if weight_value is not None and not math.isfinite(weight_value):
        weight_value = repr(weight_value)
    return {
        "token": _token(aligned),
        "n_chunks": int(aligned.n_chunks),
        "rows": _rows(aligned),
        "n_features": None if aligned.n_features is None else int(aligned.n_features),
        "roles": list(aligned.roles),
        "target": aligned.target,
        "weight": aligned.weight,
        "weight_value": weight_value,
        "feature_names": None if aligned.feature_names is None else list(aligned.feature_names),
    }


def _rows(aligned: AlignedStream) -> list[int | None]:
    """Row count of every chunk, from the first part with known array chunks."""
    for part in aligned.parts:
        if isinstance(part, da.Array):
            return [None if math.isnan(c) else int(c) for c in part.chunks[0]]
    return [None] * int(aligned.n_chunks)


def _token(aligned: AlignedStream) -> str | None:
    """The content token of the stream's parts, or ``None`` when it is not deterministic."""
    try:
        with dask.config.set({"tokenize.ensure-deterministic": True}):
            parts = [_normalized(part) for part in aligned.parts]
            return tokenize(
                parts,
                list(aligned.roles),
                aligned.target,
                aligned.weight,
                aligned.weight_value,
                ensure_deterministic=True,
            )
    except (RuntimeError, TypeError, ValueError, AttributeError):
        # dask's TokenizationError is a RuntimeError: a part Dask can only
        # hash by identity.
        return None


def _normalized(part: Any) -> Any:
    """What identifies a collection's content, as values ``tokenize`` hashes deterministically."""
    expr = getattr(part, "expr", None)
    if expr is not None and hasattr(expr, "_parameters"):
        return ("expr", _expr_token(expr, {}))
    graph = dict(part.__dask_graph__())
    return ("graph", tokenize(graph, part.__dask_keys__(), ensure_deterministic=True))


def _expr_token(expr: Any, seen: dict[str, str]) -> str:
    """A token of an expression tree: node types and operands, reader caches left out."""
    name = expr._name
    if name in seen:
        return seen[name]
    operands = []
    for parameter, operand in zip(expr._parameters, expr.operands, strict=False):
        if parameter in _CACHE_OPERANDS:
            continue
        if hasattr(operand, "_parameters") and hasattr(operand, "operands"):
            operand = ("expr", _expr_token(operand, seen))
        operands.append((parameter, operand))
    extra = []
    if "_dataset_info_cache" in expr._parameters:
        # The files' checksums (sizes and modification times): they change with the data.
        extra.append(("checksum", expr.checksum))
    token = tokenize(type(expr).__name__, operands, extra, ensure_deterministic=True)
    seen[name] = token
    return token


def check_fingerprint(expected: dict[str, Any], got: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint written for another input than the one given.

    Parameters
    ----------
    expected : dict
        The fingerprint the checkpoint holds.
    got : dict
        The fingerprint of the input of this call.
    source : str
        The checkpoint's path or URL, named in the message.

    Raises
    ------
    CheckpointError
        Naming the first field that differs (checkpoint's value first). A
        ``None`` token on either side compares only the other fields, and the
        message of a mismatch then says the tokens were not comparable.
    """
    prefix = f"the checkpoint {source} was written for another input:"
    left, right = expected.get("token"), got.get("token")
    comparable = left is not None and right is not None
    note = (
        ""
        if comparable
        else " (the data tokens were not comparable: an input part cannot be tokenized "
        "deterministically)"
    )
    for key in _FIELDS:
        a, b = expected.get(key), got.get(key)
        if key == "rows":
            difference = _rows_difference(a, b)
            if difference:
                raise CheckpointError(f"{prefix} {difference} (checkpoint != input){note}")
            continue
        if a != b:
            raise CheckpointError(f"{prefix} {key} {a!r} != {b!r} (checkpoint != input){note}")
    if comparable and left != right:
        raise CheckpointError(
            f"{prefix} the data differ (token {left} != {right}); the same collection "
            "rebuilt the same way has the same token"
        )


def _rows_difference(a: Any, b: Any) -> str:
    """The first chunk whose known row counts differ, as a message; '' when none."""
    if a is None or b is None:
        return ""
    if len(a) != len(b):
        return f"rows of {len(a)} chunks != rows of {len(b)} chunks"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x is not None and y is not None and x != y:
            return f"rows of chunk {i}: {x} != {y}"
    return ""
