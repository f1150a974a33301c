"""The ``rh-dask`` command line (also ``python -m rh_dask``).

Subcommands: ``demo``, ``fit``, ``attach``, ``predict``, ``info``, ``certs``.
``rh-dask <command> --help`` lists each one's options; ``docs/api.md``
documents them.

Exit codes (also in ``rh-dask --help``):

=====  ==================================================================
0      success
1      unexpected failure (``--traceback`` shows where)
2      usage error: unknown option, missing or malformed argument
3      bad input: missing file, unknown column, unreadable data, a chunk
       refused by validation, an invalid or corrupted model file, a stream
       checkpoint that is damaged or of another input (``--resume``), no
       detached fit of the name given to ``attach`` (or a cancelled one), an
       output path that cannot be written (checked before any work)
4      cluster failure: scheduler unreachable, no workers, engine's worker lost
       (and no recovery left), TLS credentials missing, expired, from another
       CA or refused by the scheduler
5      engine unavailable: the requested engine cannot start
6      an optional dependency is missing (the message names the extra)
130    interrupted
=====  ==================================================================
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._version import __version__
from ..exceptions import (
    ActorLostError,
    CheckpointError,
    DetachedFitError,
    EngineUnavailableError,
    RhDaskError,
    SchedulerLostError,
    StreamError,
    ValidationError,
)

__all__ = [
    "EXIT_CLUSTER",
    "EXIT_ENGINE",
    "EXIT_FAILURE",
    "EXIT_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_EXTRA",
    "EXIT_OK",
    "EXIT_USAGE",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INPUT = 3
EXIT_CLUSTER = 4
EXIT_ENGINE = 5
EXIT_MISSING_EXTRA = 6
EXIT_INTERRUPTED = 130

_EXIT_HELP = """\
exit codes:
  0  success
  1  unexpected failure (--traceback shows where)
  2  usage error
  3  bad input: missing file, unknown column, unreadable data, a chunk refused
     by validation, an invalid or corrupted model file, a stream checkpoint
     that is damaged or of another input (--resume), no detached fit of the
     name given to attach (or a cancelled one), an output path that cannot be
     written
  4  cluster failure: scheduler unreachable, no workers, engine's worker lost
     (and no recovery left), TLS credentials missing, expired, from another CA
     or refused by the scheduler
  5  engine unavailable: the requested engine cannot start
  6  an optional dependency is missing (the message names the extra)
130  interrupted (Ctrl-C)
"""


# -- argument parsing ---------------------------------------------------------------------
def _integer(text: str, least: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _positive_int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else _integer(text, 1, 'a positive integer or "auto"')


def _count(text: str) -> int:
    return _integer(text, 0, "a whole number >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value}")
    return value


#: Where ``--dashboard`` without an address serves a local cluster's dashboard.
DEFAULT_DASHBOARD = "127.0.0.1:8787"


def _keyword_default(function: Any, name: str) -> Any:
    """The default of ``function``'s parameter ``name``: one value, kept in one place."""
    return inspect.signature(function).parameters[name].default


def _add_cluster_options(parser: argparse.ArgumentParser, *, default: str) -> None:
    from .cluster import open_cluster

    timeout = _keyword_default(open_cluster, "timeout")
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--scheduler",
        default=default,
        metavar="ADDRESS|auto|local|none",
        help="scheduler address (tcp://host:8786) to connect to; 'local' starts a cluster "
        "on this machine (a LocalCUDACluster with GPU=1 workers when dask-cuda and a GPU "
        "are present, else CPU workers); 'none' runs in this process; 'auto' runs in this "
        "process when the input has fewer rows than the setting "
        "rh-dask.cli.in-process-max-rows, else as 'local' (default: %(default)s)",
    )
    group.add_argument(
        "--scheduler-file", metavar="PATH", help="connect through a dask scheduler file instead"
    )
    group.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=timeout,
        metavar="SECONDS",
        help=f"how long to wait for the scheduler and for its first worker (default: {timeout:g})",
    )
    group.add_argument(
        "--workers", type=_positive_int, metavar="N", help="worker processes of a local cluster"
    )
    group.add_argument(
        "--threads-per-worker", type=_positive_int, metavar="N", help="threads per local worker"
    )
    group.add_argument("--memory-limit", metavar="BYTES", help="memory limit per local worker")
    group.add_argument(
        "--dashboard",
        nargs="?",
        const=DEFAULT_DASHBOARD,
        metavar="ADDRESS",
        help="serve the local cluster's dashboard (at ADDRESS, default "
        f"{DEFAULT_DASHBOARD}; a bare :PORT stays on 127.0.0.1) and print its link; with a "
        "scheduler address, print that scheduler's link (default: no dashboard)",
    )
    _add_tls_options(group)


def _add_tls_options(group: Any) -> None:
    """Client credentials for a ``tls://`` scheduler (see :mod:`rh_dask.app.security`)."""
    group.add_argument(
        "--tls-dir",
        metavar="DIR",
        help="TLS credentials written by 'rh-dask certs DIR' (its ca.pem, client.pem, "
        "client-key.pem) for a tls:// scheduler; default: dask's distributed.comm.tls.* "
        "settings",
    )
    for flag, what in (("ca-file", "CA certificate"), ("cert", "certificate"), ("key", "key")):
        group.add_argument(
            f"--tls-{flag}", metavar="PATH", help=f"the client's {what} (overrides --tls-dir)"
        )


def _estimator_defaults() -> dict[str, Any]:
    """The estimator's own parameter defaults, so that the two never drift apart."""
    from ..estimator import RenewableHuberRegressor

    return RenewableHuberRegressor().get_params()


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    # Choices and defaults come from the library: its constants and the estimator's defaults.
    from ..config import DTYPES, PENALTIES
    from ..distributed.coordinator import LOADERS
    from ..engines import ENGINE_NAMES

    default = _estimator_defaults()
    group = parser.add_argument_group("model")
    group.add_argument("--engine", choices=ENGINE_NAMES, default=default["engine"])
    group.add_argument("--device", help="engine device, e.g. cuda:0 (default: the engine's)")
    group.add_argument("--dtype", choices=DTYPES, default=default["dtype"])
    group.add_argument("--penalty", choices=PENALTIES, default=default["penalty"])
    group.add_argument(
        "--tau", type=float, default=default["tau"], help=f"Huber τ (default: {default['tau']})"
    )
    group.add_argument("--lambda-scale", type=float, default=default["lambda_scale"])
    group.add_argument("--bandwidth-scale", type=float, default=default["bandwidth_scale"])
    group.add_argument("--no-intercept", action="store_true", help="fit without an intercept")
    group.add_argument("--max-iter", type=int, default=default["max_iter"])
    group.add_argument("--tol", type=float, default=default["tol"])
    group.add_argument("--ridge", type=float, default=default["ridge"])
    group.add_argument(
        "--lookahead",
        type=_positive_int_or_auto,
        default=default["lookahead"],
        help=f"chunks loading ahead, or auto (default: {default['lookahead']})",
    )
    group.add_argument(
        "--loader",
        choices=LOADERS,
        default=default["loader"],
        help="where chunks load (see docs/distributed.md)",
    )
    group.add_argument("--worker", metavar="ADDRESS", help="worker that hosts the engine actor")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_fault_tolerance_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault tolerance")
    group.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="also write the stream checkpoints of the fit here (a local path or an fsspec "
        "URL such as s3://bucket/run), so that --resume continues a fit that was "
        "interrupted or crashed (default: checkpoints held in memory only)",
    )
    group.add_argument(
        "--checkpoint-every",
        type=_positive_int,
        metavar="N",
        help="a stream checkpoint after every N chunks (default: the setting "
        "rh-dask.checkpoint.every-chunks)",
    )
    group.add_argument(
        "--max-retries",
        type=_count,
        metavar="N",
        help="recoveries from a lost engine worker allowed in the fit; 0: fail at once "
        "(default: the setting rh-dask.recovery.max-retries)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the stream checkpoint in --checkpoint-dir (same input, same model "
        "options); when it holds none, fit from the first chunk",
    )
    group.add_argument(
        "--detach",
        action="store_true",
        help="run the fit inside the cluster of --scheduler ADDRESS (or --scheduler-file) "
        "and return at once, printing its name; 'rh-dask attach NAME' collects the model",
    )


def _add_remote_options(parser: argparse.ArgumentParser) -> None:
    from .cluster import open_cluster

    timeout = _keyword_default(open_cluster, "timeout")
    group = parser.add_argument_group("cluster")
    group.add_argument(
        "--scheduler", metavar="ADDRESS", help="address of the scheduler (tcp://host:8786)"
    )
    group.add_argument(
        "--scheduler-file", metavar="PATH", help="connect through a dask scheduler file instead"
    )
    group.add_argument(
        "--connect-timeout",
        type=_positive_float,
        default=timeout,
        metavar="SECONDS",
        help=f"how long to wait for the scheduler (default: {timeout:g})",
    )
    _add_tls_options(group)


def build_parser() -> argparse.ArgumentParser:
    """The ``rh-dask`` argument parser."""
    from ..datasets import StreamSpec
    from .io import write_predictions

    parser = argparse.ArgumentParser(
        prog="rh-dask",
        description="Renewable Huber regression on data too large for one machine.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"rh-dask {__version__}")
    parser.add_argument(
        "--traceback", action="store_true", help="print the full traceback on errors"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="fit a generated outlier-contaminated stream end to end",
        description="Write a heavy-tailed, outlier-contaminated stream to a temporary "
        "Parquet dataset, fit it on a local cluster, and compare with least squares.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--rows", type=_positive_int, default=1_048_576)
    demo.add_argument("--chunk-rows", type=_positive_int, default=65_536)
    spec = StreamSpec()
    demo.add_argument("--features", type=_positive_int, default=spec.n_features)
    demo.add_argument("--seed", type=int, default=spec.seed)
    demo.add_argument(
        "--output-dir",
        type=Path,
        default=Path("rh-dask-output/demo"),
        help="where model.npz and report/ go (default: rh-dask-output/demo)",
    )
    demo.add_argument(
        "--data-dir",
        type=Path,
        help="write the generated data here and keep it (default: "
        "a temporary directory, removed afterwards)",
    )
    _add_model_options(demo)
    _add_cluster_options(demo, default="local")
    demo.set_defaults(handler=_cmd_demo)

    fit = commands.add_parser(
        "fit",
        help="fit a model on Parquet, CSV, Zarr or .npy data",
        description="Fit a renewable Huber model on data on disk; its row chunks "
        "(partitions) are the batches, in order.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_input_options(fit, target_required=True)
    fit.add_argument("--weight", metavar="COL", help="column of frequency weights")
    _add_exclude_option(fit, "(e.g. an id column)")
    fit.add_argument(
        "--output",
        required=True,
        type=Path,
        metavar="MODEL.npz",
        help="where to save the model (.npz is appended when it is not the suffix)",
    )
    fit.add_argument("--report", type=Path, metavar="DIR", help="write report.json and plots")
    _add_model_options(fit)
    _add_cluster_options(fit, default="auto")
    _add_fault_tolerance_options(fit)
    fit.set_defaults(handler=_cmd_fit)

    attach = commands.add_parser(
        "attach",
        help="reconnect to a detached fit, watch it and collect its model",
        description="Reconnect to a fit started with 'rh-dask fit --detach', show its "
        "progress until it ends, and save its model and report like 'fit' does.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    attach.add_argument("name", metavar="NAME", help="the name 'rh-dask fit --detach' printed")
    attach.add_argument(
        "--output",
        type=Path,
        metavar="MODEL.npz",
        help="save the model here (.npz is appended when it is not the suffix); once "
        "saved, the fit is forgotten by the scheduler",
    )
    attach.add_argument("--report", type=Path, metavar="DIR", help="write report.json and plots")
    attach.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_remote_options(attach)
    attach.set_defaults(handler=_cmd_attach)

    predict = commands.add_parser(
        "predict",
        help="predict from a saved model, out of core",
        description="Predict from a saved model chunk by chunk; the output format "
        "follows the suffix: .parquet (a dataset directory), .csv or .npy.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    predict.add_argument("--model", required=True, type=Path, metavar="MODEL.npz")
    _add_input_options(predict, target_required=False)
    _add_exclude_option(predict, "(e.g. the target)")
    predict.add_argument("--output", required=True, type=Path, metavar="PATH")
    predict.add_argument(
        "--column",
        default=_keyword_default(write_predictions, "column"),
        help="output column name (default: %(default)s)",
    )
    predict.add_argument("--overwrite", action="store_true", help="replace an existing output")
    _add_cluster_options(predict, default="auto")
    predict.set_defaults(handler=_cmd_predict)

    info = commands.add_parser(
        "info",
        help="show a saved model",
        description="Show a checkpoint's configuration, counters and coefficients.",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    info.add_argument("model", type=Path, metavar="MODEL.npz")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(handler=_cmd_info)

    certs = commands.add_parser(
        "certs",
        help="write a CA and TLS certificates for a scheduler, its workers and a client",
        description="Write a new certificate authority (ca.pem) and, signed by it, a "
        "certificate and private key for each role: scheduler, worker, client. The CA's "
        "own key is not kept. Needs the cryptography package (rh-dask[tls]).",
        epilog=_EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    certs.add_argument("directory", type=Path, metavar="DIR", help="where the files go")
    certs.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name or IP the scheduler and workers are reached at, written into "
        "their certificates (repeatable; localhost and 127.0.0.1 always are)",
    )
    certs.add_argument(
        "--days", type=_positive_float, default=365.0, help="validity (default: %(default)g)"
    )
    existing = certs.add_mutually_exclusive_group()
    existing.add_argument(
        "--keep", action="store_true", help="a complete set already in DIR is checked and kept"
    )
    existing.add_argument("--force", action="store_true", help="replace credentials in DIR")
    certs.set_defaults(handler=_cmd_certs)
    return parser


def _add_exclude_option(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="COL",
        help=f"columns left out of the default features {example}; each must be a "
        "column of the input",
    )


def _add_input_options(parser: argparse.ArgumentParser, *, target_required: bool) -> None:
    from .io import INPUT_FORMATS

    group = parser.add_argument_group("input")
    group.add_argument(
        "--input", required=True, metavar="PATH_OR_GLOB", help="file, directory or quoted glob"
    )
    group.add_argument("--format", choices=INPUT_FORMATS)
    if target_required:
        group.add_argument(
            "--target",
            required=True,
            metavar="COL",
            help="target column (name; a position like -1 for a 2-D array; an array "
            "name in a Zarr group)",
        )
    group.add_argument(
        "--features",
        nargs="+",
        metavar="COL",
        help="feature columns (names; positions or ranges like 0:20 for 2-D arrays); "
        "default: every other column",
    )
    group.add_argument(
        "--chunk-rows",
        type=_positive_int,
        metavar="N",
        help="re-cut the stream into batches of N rows (default: the input's own chunks)",
    )


# -- shared steps -------------------------------------------------------------------------
def _check_usage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of options argparse cannot refuse by itself (exit 2)."""
    if getattr(args, "dashboard", None) is not None and args.scheduler == "none":
        parser.error("--dashboard needs a cluster: --scheduler local, auto or an address")
    if args.command == "fit":
        if args.resume and args.checkpoint_dir is None:
            parser.error("--resume needs --checkpoint-dir DIR: where the checkpoint to resume is")
        if args.detach and not _remote(args):
            parser.error(
                "--detach needs a running scheduler: --scheduler ADDRESS or --scheduler-file "
                f"PATH (a cluster started by the command, --scheduler {args.scheduler}, "
                "would stop with it)"
            )
        if args.detach and args.resume:
            parser.error(
                "--detach and --resume exclude each other: a detached fit with "
                "--checkpoint-dir resumes by itself when the cluster reruns it"
            )
    tls = [f"--{n.replace('_', '-')}" for n in _TLS_OPTIONS if getattr(args, n, None)]
    if tls and args.scheduler_file is None and not _remote(args):
        parser.error(
            f"{tls[0]} is for a scheduler of its own: --scheduler tls://HOST:PORT or "
            "--scheduler-file (a cluster this command starts listens on 127.0.0.1 only)"
        )
    if args.command == "attach" and not _remote(args):
        parser.error("attach needs the fit's scheduler: --scheduler ADDRESS or --scheduler-file")


def _remote(args: argparse.Namespace) -> bool:
    """Whether the command names a running scheduler (not one it starts or none)."""
    if args.scheduler_file is not None:
        return True
    return args.scheduler not in (None, "auto", "local", "none")


#: The client's TLS options (``--tls-dir``, ...), as attribute names.
_TLS_OPTIONS = ("tls_dir", "tls_ca_file", "tls_cert", "tls_key")


def _security(args: argparse.Namespace) -> Any:
    """The client ``Security`` for the command's scheduler, or ``None`` for plain TCP."""
    from .security import client_security, scheduler_address

    if args.scheduler_file is None and not _remote(args):
        return None
    return client_security(
        scheduler_address(args.scheduler, args.scheduler_file),
        tls_dir=args.tls_dir,
        ca_file=args.tls_ca_file,
        cert=args.tls_cert,
        key=args.tls_key,
    )


#: Options that only mean something on a local cluster: given, ``auto`` starts one.
_CLUSTER_OPTIONS = ("workers", "threads_per_worker", "memory_limit", "dashboard", "worker")


def _choose_scheduler(args: argparse.Namespace, table: Any) -> tuple[str, str | None]:
    """The ``--scheduler`` to use, and a line saying why when ``auto`` stays in-process.

    ``auto`` runs in this process when the input is known, from metadata, to
    have fewer rows than the ``rh-dask.cli.in-process-max-rows`` setting:
    a local cluster costs seconds to start, which a small fit does not
    repay. An option that only makes sense on a cluster (``--workers``,
    ``--dashboard``, ``--loader`` other than auto, ...) starts one, and so
    does a machine where ``local`` means a GPU cluster (dask-cuda and a
    GPU): the threshold was measured against CPU clusters, and the GPU
    engine is what such a cluster brings.
    """
    if args.scheduler != "auto" or args.scheduler_file is not None:
        return args.scheduler, None
    if table is None:  # nothing to measure
        return "local", None
    if any(getattr(args, name, None) is not None for name in _CLUSTER_OPTIONS):
        return "local", None
    if getattr(args, "loader", "auto") != "auto":
        return "local", None
    from .cluster import gpu_count

    if gpu_count() > 0:
        return "local", None
    from ..settings import in_process_max_rows
    from .io import input_files
    from .sizing import input_rows

    limit = in_process_max_rows()
    count = input_rows(
        table, input_files(table.description["path"], table.description["format"]), limit
    )
    if count is None or count.rows >= limit:
        return "local", None
    return "none", (
        f"in-process: {count} rows below the cluster threshold ({limit:,}); "
        "--scheduler local to force a cluster"
    )


def _session(args: argparse.Namespace, table: Any = None) -> Any:
    """Open the cluster of the command and say on stdout what it is."""
    from .cluster import open_cluster

    scheduler, note = _choose_scheduler(args, table)
    session = open_cluster(
        scheduler,
        scheduler_file=args.scheduler_file,
        timeout=args.connect_timeout,
        n_workers=args.workers,
        threads_per_worker=args.threads_per_worker,
        memory_limit=args.memory_limit,
        dashboard=args.dashboard,
        security=_security(args),
    )
    try:
        if note is not None:
            print(note, flush=True)
        elif session.client is None:
            print("in-process: no cluster (--scheduler none)", flush=True)
        else:
            print(f"cluster: {session.kind} at {session.address}", flush=True)
        if args.dashboard is not None:
            print(f"dashboard: {_dashboard_line(session)}", flush=True)
    except BaseException:
        session.close()
        raise
    return session


def _dashboard_line(session: Any) -> str:
    import importlib.util

    link = session.dashboard_link
    if link is None:
        return "not served by this scheduler"
    if session.kind.startswith("local") and importlib.util.find_spec("bokeh") is None:
        return f"{link} (its plots need bokeh: pip install 'bokeh>=3.1')"
    return link


def _estimator(args: argparse.Namespace, engine: str) -> Any:
    from ..estimator import RenewableHuberRegressor

    return RenewableHuberRegressor(
        tau=args.tau,
        penalty=args.penalty,
        lambda_scale=args.lambda_scale,
        bandwidth_scale=args.bandwidth_scale,
        fit_intercept=not args.no_intercept,
        max_iter=args.max_iter,
        tol=args.tol,
        ridge=args.ridge,
        engine=engine,
        device=args.device,
        dtype=args.dtype,
        lookahead=args.lookahead,
        loader=args.loader,
        worker=args.worker,
        progress=False if args.no_progress else None,  # None: a bar on a terminal
        checkpoint_every=getattr(args, "checkpoint_every", None),
        checkpoint_dir=getattr(args, "checkpoint_dir", None),
        max_retries=getattr(args, "max_retries", None),
    )


def _engine_for(args: argparse.Namespace, session: Any) -> tuple[str, str | None]:
    """The engine to ask for, and the one to fall back to when it cannot start.

    ``--engine auto`` is the estimator's ``engine="auto"``, in this process
    and on a cluster alike: on a cluster the engine's actor goes to a GPU
    worker when there is one and decides there at the first chunk, a
    measured GPU choice that cannot start falling back to NumPy itself. A
    named engine never falls back.
    """
    return args.engine, None


def _fit_and_save(
    args: argparse.Namespace,
    table: Any,
    session: Any,
    output: Path,
) -> tuple[Any, Path]:
    """Fit ``table`` on ``session`` and save the model; returns the outcome and its path."""
    from .jobs import fit_table

    engine, fallback = _engine_for(args, session)
    model = _estimator(args, engine)
    outcome = fit_table(
        model, table, fallback_engine=fallback, resume=getattr(args, "resume", False)
    )
    saved = model.save(output)
    return outcome, Path(saved)


def _plural(count: int, word: str) -> str:
    return f"{count:,} {word}{'' if count == 1 else 's'}"


def _summary(outcome: Any) -> str:
    model = outcome.model
    rows = outcome.rows_this_call
    chunks = outcome.chunks_this_call
    empty = int(model.n_empty_chunks_)
    rate = rows / outcome.seconds if outcome.seconds > 0 else float("nan")
    where = ""
    if outcome.placement:
        where = f" on {outcome.placement.get('worker')}"
    skipped = f", {empty} empty skipped" if empty else ""
    engine = f"(engine {outcome.engine}{where}, {model.dtype})"
    if outcome.resumed_from is None:
        return (
            f"fitted {rows:,} rows in {_plural(chunks, 'chunk')}{skipped} in "
            f"{outcome.seconds:.2f} s: "
            f"{rate:,.0f} rows/s {engine}"
        )
    total = int(model.n_samples_seen_)
    return (
        f"resumed at chunk {outcome.resumed_from}: fitted {_plural(rows, 'more row')} in "
        f"{_plural(chunks, 'chunk')} in {outcome.seconds:.2f} s: {rate:,.0f} rows/s; "
        f"{total:,} rows in {_plural(len(outcome.history), 'chunk')}{skipped} in all {engine}"
    )


def _write_report(
    directory: Path,
    outcome: Any,
    data: dict[str, Any],
    feature_names: list[str],
    session: Any,
    saved: Path | None,
    timings: dict[str, float],
    argv: Sequence[str],
    **kwargs: Any,
) -> list[Path]:
    from .report import build_report, write_report

    truth = kwargs.pop("truth", None)
    report = build_report(
        outcome,
        data=data,
        feature_names=feature_names,
        session=session,
        command=["rh-dask", *argv],
        timings=timings,
        model_path=None if saved is None else str(saved),
        **kwargs,
    )
    return write_report(directory, report, truth=truth)


# -- interruptions and failures with advice ---------------------------------------------------
def _explained(line: str) -> KeyboardInterrupt:
    """A Ctrl-C the command explains in one line (what was kept, how to go on).

    Still a plain ``KeyboardInterrupt`` (an interrupt, not an error): the
    line rides on it as ``rh_dask_line``.
    """
    interrupt = KeyboardInterrupt(line)
    interrupt.rh_dask_line = line  # type: ignore[attr-defined]
    return interrupt


def _line_of(interrupt: KeyboardInterrupt) -> str | None:
    return getattr(interrupt, "rh_dask_line", None)


class _Advised(RhDaskError):
    """An error of a command, with advice appended to its line; exits as ``cause`` does."""

    def __init__(self, cause: Exception, advice: str) -> None:
        super().__init__(f"{cause}; {advice}")
        self.cause = cause
        self.advice = advice


def _resume_command(args: argparse.Namespace, argv: Sequence[str]) -> str:
    """The command line that resumes this fit: the same one, with ``--resume``."""
    words = ["rh-dask", *argv, *([] if args.resume else ["--resume"])]
    return shlex.join(words)


def _kept(args: argparse.Namespace, before: Any) -> Any:
    """The stream checkpoint this fit left in ``--checkpoint-dir``, ``None`` when none."""
    from .jobs import peek_checkpoint, walked_by

    after = peek_checkpoint(args.checkpoint_dir)
    # A resumed fit stopped before its first new chunk still leaves a resumable checkpoint.
    return after if args.resume else walked_by(after, before)


def _interrupted_fit(args: argparse.Namespace, argv: Sequence[str], before: Any) -> str:
    """The line an interrupted ``fit`` ends with: what it kept and how to resume."""
    if args.checkpoint_dir is None:
        return "interrupted; nothing was kept (--checkpoint-dir DIR keeps a checkpoint to resume)"
    kept = _kept(args, before)
    if kept is None:
        return (
            f"interrupted before the first chunk was fitted: {args.checkpoint_dir} holds "
            "nothing of this fit to resume"
        )
    walk = kept.walk
    return (
        f"interrupted: stopped after {walk.next_chunk} of {walk.n_chunks} chunks; the "
        f"checkpoint in {args.checkpoint_dir} keeps them; resume with: "
        f"{_resume_command(args, argv)}"
    )


def _failed_fit(
    args: argparse.Namespace, argv: Sequence[str], before: Any, exc: Exception
) -> Exception:
    """``exc`` with the command that resumes the fit, when a checkpoint of it was kept.

    Only for failures a rerun can get past (a lost worker or scheduler, a chunk
    whose loading failed); a chunk refused for its data would be refused again.
    """
    from ..exceptions import BadChunkError

    if args.checkpoint_dir is None or isinstance(exc, BadChunkError):
        return exc
    kept = _kept(args, before)
    if kept is None:
        return exc
    walk = kept.walk
    return _Advised(
        exc,
        f"the checkpoint in {args.checkpoint_dir} keeps {walk.next_chunk} of "
        f"{walk.n_chunks} chunks; resume with: {_resume_command(args, argv)}",
    )


# -- commands -------------------------------------------------------------------------------
def _check_checkpoint_dir(location: str | None) -> None:
    """A local ``--checkpoint-dir`` must be a directory this process can create and write."""
    from .io import _is_url
    from .outputs import check_directory

    if location is not None and not _is_url(location):
        check_directory(location, "--checkpoint-dir", files=("stream.npz",))


def _cmd_fit(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .extras import require
    from .io import open_table
    from .jobs import peek_checkpoint
    from .outputs import check_directory, check_file, model_path
    from .report import REPORT_FILES

    check_file(args.output, "--output")  # a directory given as the model is refused
    check_file(model_path(args.output), "--output")
    if args.report is not None:
        check_directory(args.report, "--report", files=REPORT_FILES)
        require("matplotlib", "report", "--report")
    if not args.detach:  # a detached fit writes its checkpoints from a worker
        _check_checkpoint_dir(args.checkpoint_dir)
    start = time.perf_counter()
    table = open_table(
        args.input,
        target=args.target,
        features=args.features,
        weight=args.weight,
        exclude=args.exclude,
        chunk_rows=args.chunk_rows,
        fmt=args.format,
    )
    opened = time.perf_counter()
    if args.detach:
        with _session(args, table) as session:
            return _detach(args, table, session)
    before = peek_checkpoint(args.checkpoint_dir)  # an earlier fit's, for the messages
    try:
        with _session(args, table) as session:
            connected = time.perf_counter()
            try:
                outcome, saved = _fit_and_save(args, table, session, args.output)
            except StreamError as exc:  # a lost worker or scheduler too
                raise _failed_fit(args, argv, before, exc) from exc
            print(_summary(outcome))
            for note in outcome.notes:
                print(f"note: {note}")
            print(f"model: {saved}")
            if args.report is not None:
                timings = {
                    "open_seconds": opened - start,
                    "connect_seconds": connected - opened,
                }
                files = _write_report(
                    args.report,
                    outcome,
                    table.description,
                    table.feature_names,
                    session,
                    saved,
                    timings,
                    argv,
                )
                print(f"report: {files[0].parent} ({', '.join(f.name for f in files)})")
    except KeyboardInterrupt as exc:
        if _line_of(exc) is not None:
            raise
        raise _explained(_interrupted_fit(args, argv, before)) from exc
    return EXIT_OK


#: Suffix of the published name under which ``fit --detach`` leaves what a report needs.
_CONTEXT_SUFFIX = "-cli"


def _detach(args: argparse.Namespace, table: Any, session: Any) -> int:
    """Submit the fit into the cluster, say how to collect it, and return."""
    from ..distributed import submit_fit
    from .io import _is_url

    engine, _ = _engine_for(args, session)  # no fallback: nothing here sees the engine start
    model = _estimator(args, engine)
    if args.checkpoint_dir is not None and not _is_url(args.checkpoint_dir):
        # Written from a worker, whose working directory is not this one.
        model.set_params(checkpoint_dir=os.path.abspath(args.checkpoint_dir))
    fit = submit_fit(model, *table.fit_inputs(), client=session.client)
    # What the report of 'attach' needs and only this process knows: the input's description.
    context = {"data": table.description, "feature_names": list(table.feature_names)}
    session.client.publish_dataset(**{fit.name + _CONTEXT_SUFFIX: context})
    command = ["rh-dask", "attach", fit.name]
    if args.scheduler_file is not None:
        command += ["--scheduler-file", os.path.abspath(args.scheduler_file)]
    else:
        command += ["--scheduler", session.address]
    for name in _TLS_OPTIONS:
        if getattr(args, name) is not None:
            command += [f"--{name.replace('_', '-')}", os.path.abspath(getattr(args, name))]
    command += ["--output", os.path.abspath(args.output)]
    if args.report is not None:
        command += ["--report", os.path.abspath(args.report)]
    print(f"detached fit: {fit.name} on {session.address}")
    print(f"collect it with: {shlex.join(command)}")
    return EXIT_OK


def _cmd_attach(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..distributed import DetachedFit
    from ..distributed.progress import progress_enabled
    from .cluster import open_cluster
    from .extras import require
    from .jobs import collect_detached
    from .outputs import check_directory, check_file, model_path
    from .report import REPORT_FILES

    if args.output is not None:
        check_file(args.output, "--output")
        check_file(model_path(args.output), "--output")
    if args.report is not None:
        check_directory(args.report, "--report", files=REPORT_FILES)
        require("matplotlib", "report", "--report")
    again = ["rh-dask", *argv]
    with open_cluster(
        args.scheduler,
        scheduler_file=args.scheduler_file,
        timeout=args.connect_timeout,
        security=_security(args),
    ) as session:
        print(f"cluster: {session.kind} at {session.address}", flush=True)
        fit = DetachedFit.attach(args.name, client=session.client)
        done = fit.progress()
        count = done["n_chunks"]
        where = "" if count is None else f", {done['chunks_done']} of {count} chunks"
        print(f"detached fit {args.name}: {fit.status()}{where}", flush=True)
        try:
            outcome = collect_detached(
                fit, progress=progress_enabled(False if args.no_progress else None)
            )
        except KeyboardInterrupt as exc:
            raise _explained(
                f"interrupted; the detached fit {args.name} goes on in the cluster: "
                f"{shlex.join(again)} collects it"
            ) from exc
        print(_summary(outcome))
        for note in outcome.notes:
            print(f"note: {note}")
        saved = None
        if args.output is not None:
            saved = Path(outcome.model.save(args.output))
            print(f"model: {saved}")
        if args.report is not None:
            context = _detached_context(session.client, args.name, outcome.model)
            files = _write_report(
                args.report,
                outcome,
                context["data"],
                context["feature_names"],
                session,
                saved,
                {},
                argv,
            )
            print(f"report: {files[0].parent} ({', '.join(f.name for f in files)})")
        if saved is not None:  # the model is on disk: the scheduler need not keep the fit
            fit.forget()
            session.client.unpublish_dataset(args.name + _CONTEXT_SUFFIX)
    return EXIT_OK


def _detached_context(client: Any, name: str, model: Any) -> dict[str, Any]:
    """What ``fit --detach`` published for the report; the model's own facts when it did not.

    A fit submitted from Python (:func:`rh_dask.distributed.submit_fit`) has no
    published description of its input; its report names the features as the
    model does.
    """
    context = client.get_dataset(name + _CONTEXT_SUFFIX, default=None)
    if context is not None:
        return context
    names = getattr(model, "feature_names_in_", None)
    if names is None:
        names = [f"x{j}" for j in range(model.n_features_in_)]
    return {"data": {"detached": name}, "feature_names": [str(n) for n in names]}


def _cmd_predict(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..estimator import RenewableHuberRegressor
    from .io import InputError, open_table, output_format, write_predictions
    from .outputs import check_dataset, check_file

    # The output is checked before any work: its suffix, then its place.
    if output_format(args.output) == "parquet":  # a dataset directory
        check_dataset(args.output, "--output", overwrite=args.overwrite)
    else:
        check_file(args.output, "--output", overwrite=args.overwrite)
    model = RenewableHuberRegressor.load(args.model)
    options = {"exclude": args.exclude, "chunk_rows": args.chunk_rows, "fmt": args.format}
    table = open_table(args.input, features=args.features, **options)
    names = getattr(model, "feature_names_in_", None)
    if args.features is None and names is not None and table.named:
        # A table: take the model's feature columns by name, whatever else it holds.
        table = open_table(args.input, features=[str(n) for n in names], **options)
    width = int(table.X.shape[1])
    if width != model.n_features_in_:
        raise InputError(
            f"{args.input!r} gives {width} feature columns, the model expects "
            f"{model.n_features_in_}; choose them with --features or --exclude"
        )
    start = time.perf_counter()
    # The session's client becomes dask's default scheduler for the writes.
    with _session(args, table):
        written = write_predictions(
            model.predict(table.X), args.output, column=args.column, overwrite=args.overwrite
        )
    seconds = time.perf_counter() - start
    rows = f"{written['rows']:,} predictions" if written["rows"] is not None else "predictions"
    print(f"wrote {rows} to {written['path']} ({written['format']}) in {seconds:.2f} s")
    return EXIT_OK


def _cmd_info(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..checkpoint import load_checkpoint
    from ..exceptions import InferenceError
    from ..inference import summarize

    ckpt = load_checkpoint(args.model)
    try:
        summary = summarize(
            ckpt.state,
            tau=ckpt.config.tau,
            penalty=ckpt.config.penalty,
            dtype=ckpt.config.dtype,
            feature_names=ckpt.feature_names,
            engine=ckpt.engine,
        )
        unavailable = None
    except InferenceError as exc:
        summary, unavailable = None, str(exc)
    state = ckpt.state
    d = state.n_features_in
    names = (
        [str(n) for n in ckpt.feature_names]
        if ckpt.feature_names is not None
        else [f"x{j}" for j in range(d)]
    )
    coefficients = dict(zip(names, (float(c) for c in state.coefficients[:d]), strict=True))
    if state.fit_intercept:
        coefficients["(intercept)"] = float(state.coefficients[-1])
    record = {
        "path": str(args.model),
        "library_version": ckpt.library_version,
        "engine": ckpt.engine,
        "config": ckpt.config.to_dict(),
        "counters": state.counters(),
        "feature_names": None if ckpt.feature_names is None else names,
        "coefficients": coefficients,
        "inference": summary.to_dict() if summary is not None else {"unavailable": unavailable},
    }
    if args.json:
        print(json.dumps(record, indent=2))
        return EXIT_OK
    config = " ".join(f"{k}={v}" for k, v in record["config"].items())
    counters = state.counters()
    lines = [
        f"{args.model} (rh-dask checkpoint, written by rh-dask {ckpt.library_version})",
        f"engine: {ckpt.engine}",
        f"config: {config}",
        f"stream: {counters['n_samples_seen']:,} rows in {counters['batch_count']:,} batches, "
        f"weight sum {counters['weight_sum']:g}, last lambda {counters['previous_lambda']:g}",
        f"features: {d}" + ("" if ckpt.feature_names is not None else " (unnamed: x0, x1, ...)"),
        "coefficients:",
    ]
    width = max(len(n) for n in coefficients)
    lines += [f"  {name:<{width}}  {value: .6g}" for name, value in coefficients.items()]
    lines += ["", summary.as_text()] if summary is not None else [f"inference: {unavailable}"]
    print("\n".join(lines))
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import shutil

    from ..datasets import StreamSpec
    from .demo import compare, write_stream
    from .extras import require
    from .io import open_table
    from .outputs import check_directory
    from .report import REPORT_FILES

    out = check_directory(args.output_dir, "--output-dir", files=("model.npz",))
    check_directory(out / "report", "--output-dir", files=REPORT_FILES)
    if args.data_dir is not None:
        check_directory(args.data_dir, "--data-dir", empty=True)
    require("pyarrow", "io", "the demo's Parquet data")
    require("matplotlib", "report", "the demo's report")
    out.mkdir(parents=True, exist_ok=True)
    spec = StreamSpec(n_features=args.features, seed=args.seed)
    scratch = None
    if args.data_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="rh-dask-demo-"))
        data_path = scratch / "stream.parquet"
    else:
        data_path = args.data_dir
    try:
        with _session(args) as session:
            written = write_stream(spec, args.rows, args.chunk_rows, data_path, args.dtype)
            print(
                f"data: {written['rows']:,} rows x {args.features} features in "
                f"{written['chunks']} Parquet files at {data_path} ({written['seconds']:.1f} s)"
            )
            table = open_table(data_path, target="y")
            outcome, saved = _fit_and_save(args, table, session, out / "model.npz")
            huber = outcome.trajectory.coefficients[-1]
            tick = time.perf_counter()
            comparison = compare(spec, huber, table)
            ols_seconds = time.perf_counter() - tick
            print(_summary(outcome))
            ratio = comparison.ols_error / comparison.huber_error
            print(
                f"coefficient error ‖β̂ − β‖₂: renewable Huber {comparison.huber_error:.4f}, "
                f"least squares {comparison.ols_error:.4f} ({ratio:.1f}x larger)"
            )
            files = _write_report(
                out / "report",
                outcome,
                table.description,
                table.feature_names,
                session,
                saved,
                {"generate_seconds": written["seconds"], "least_squares_seconds": ols_seconds},
                argv,
                truth=comparison.truth,
                extra={"demo": {"spec": vars(spec), **comparison.to_dict()}},
            )
        print(f"model: {saved}")
        print(f"report: {files[0].parent} ({', '.join(f.name for f in files)})")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return EXIT_OK


def _cmd_certs(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .security import write_credentials

    existing = "keep" if args.keep else "replace" if args.force else "refuse"
    kept = args.keep and (args.directory / "ca.pem").exists()
    files = write_credentials(args.directory, hosts=args.host, days=args.days, existing=existing)
    verb = "kept" if kept else "wrote"
    print(f"{verb} TLS credentials in {args.directory}: {', '.join(f.name for f in files)}")
    if not kept:
        print(f"valid for {args.days:g} days; the CA's private key was not kept")
    return EXIT_OK


# -- errors and the entry point ---------------------------------------------------------------
def _exit_code(exc: BaseException) -> int:
    from ..settings import SettingError
    from .cluster import ClusterError
    from .extras import MissingExtraError
    from .io import InputError

    if isinstance(exc, SettingError):
        return EXIT_USAGE
    if isinstance(exc, MissingExtraError):
        return EXIT_MISSING_EXTRA
    if isinstance(exc, (ClusterError, ActorLostError, SchedulerLostError)):
        return EXIT_CLUSTER
    if isinstance(exc, EngineUnavailableError):
        return EXIT_ENGINE
    if isinstance(
        exc, (InputError, ValidationError, CheckpointError, StreamError, DetachedFitError)
    ):
        return EXIT_INPUT
    return EXIT_FAILURE


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


#: What Python says when it collects the coroutine of a wait on an actor that an
#: interrupt abandoned (distributed's ``ActorFuture``): nothing was lost, the
#: interrupt's own line says what was kept.
_ABANDONED_WAIT = r"coroutine '.*ActorFuture\._result' was never awaited"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ABANDONED_WAIT, category=RuntimeWarning)
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        return args.handler(args, argv)
    except KeyboardInterrupt as exc:
        line = _line_of(exc) or "interrupted"
        exc.__traceback__ = None  # its frames hold the abandoned wait, if any
        gc.collect()  # which is collected here, under main's filter
        print(f"rh-dask: {line}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`rh-dask info m.npz | head`): stop
        # quietly, and keep the interpreter from complaining while it flushes.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:
        cause = exc.cause if isinstance(exc, _Advised) else exc
        code = _exit_code(cause)
        if args.traceback:
            traceback.print_exception(cause)
        prefix = "error" if code != EXIT_FAILURE else f"unexpected {type(cause).__name__}"
        hint = "" if code != EXIT_FAILURE or args.traceback else " (--traceback for details)"
        print(f"rh-dask: {prefix}: {_one_line(exc)}{hint}", file=sys.stderr)
        return code
