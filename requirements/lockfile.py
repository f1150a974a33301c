"""Write, check and compare the lock files of requirements/ (``name==version`` per line).

A lock is ``pip freeze --all`` of one environment (pip and setuptools included,
the project itself left out) under a comment header; the header's
``# python_version: X.Y`` line names the Python minor the lock was made on.
Every command inspects the interpreter that runs it, so run it with the
environment's own Python::

    python requirements/lockfile.py check-python requirements/ci.txt
    .venv/bin/python requirements/lockfile.py verify requirements/ci.txt
    .venv/bin/python requirements/lockfile.py diff requirements/ci.txt
    .venv/bin/python requirements/lockfile.py write requirements/ci.txt
    .venv/bin/python requirements/lockfile.py versions dask numpy

Only the standard library is used: the interpreter may be a bare one.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PROJECT = "rh-dask"
PYTHON_LINE = re.compile(r"^#\s*python_version:\s*(\d+)\.(\d+)\s*$")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")

HEADER = """\
# Exact versions of every package that `make test`, `make demo` and CI install
# (pip and setuptools, the build backend, included: the project is installed
# with --no-build-isolation, so its build uses the setuptools below). The
# project itself is not listed.
#
# python_version: {minor}
# Made on CPython {full} ({platform}); CI runs CPython 3.11. The Makefile
# tries this lock on another Python minor first and falls back to the
# newest releases only where it cannot install there.
#
# Refresh (a throwaway environment with the newest releases of everything
# pyproject.toml asks for, frozen into this file):  make lock
"""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> tuple[dict[str, tuple[str, str]], tuple[int, int] | None]:
    """The pins of a lock file and the Python minor its header names.

    Returns
    -------
    pins : dict
        Canonical name -> (name as written, version).
    python : tuple of int or None
        ``(major, minor)`` from ``# python_version:``, or None without that line.
    """
    pins: dict[str, tuple[str, str]] = {}
    python = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        header = PYTHON_LINE.match(line)
        if header:
            python = (int(header[1]), int(header[2]))
            continue
        if not line or line.startswith("#"):
            continue
        pin = PIN.match(line)
        if pin is None:
            raise SystemExit(f"{path}:{number}: not a name==version line: {raw!r}")
        pins[canonical(pin[1])] = (pin[1], pin[2])
    return pins, python


def installed() -> dict[str, tuple[str, str]]:
    """Distributions of this interpreter's environment, the project excluded."""
    found: dict[str, tuple[str, str]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and canonical(name) != PROJECT:
            found.setdefault(canonical(name), (name, dist.version))
    return found


def differences(lock: dict, have: dict) -> list[str]:
    """One line per package whose installed version is not the locked one."""
    lines = []
    for key in sorted(lock.keys() | have.keys()):
        if key not in have:
            lines.append(f"{lock[key][0]} {lock[key][1]} -> (not installed)")
        elif key not in lock:
            lines.append(f"{have[key][0]} (not in the lock) -> {have[key][1]}")
        elif lock[key][1] != have[key][1]:
            lines.append(f"{lock[key][0]} {lock[key][1]} -> {have[key][1]}")
    return lines


def cmd_check_python(path: Path) -> int:
    _, python = read_lock(path)
    here = sys.version_info[:2]
    if python is None:
        print(f"note: {path} names no python_version; not checked")
        return 0
    if python != here:
        print(
            f"error: {path} is a lock for Python {python[0]}.{python[1]}, but "
            f"{sys.executable} is Python {here[0]}.{here[1]}.\n"
            f"  Use that Python (make ... PYTHON=python{python[0]}.{python[1]}), or run the "
            f"suite against the newest releases, unlocked: make test-latest",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_verify(path: Path) -> int:
    lock, _ = read_lock(path)
    problems = differences(lock, installed())
    if problems:
        print(
            f"error: this environment ({sys.prefix}) is not the one {path} locks:",
            file=sys.stderr,
        )
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print(
            "  A package missing from the lock means pyproject.toml needs more than the "
            "lock has: refresh it with `make lock`. Leftovers of an older lock go with "
            "`make clean`.",
            file=sys.stderr,
        )
        return 1
    print(f"environment matches {path} ({len(lock)} packages)")
    return 0


def cmd_diff(path: Path) -> int:
    lock, _ = read_lock(path)
    for line in differences(lock, installed()):
        print(line)
    return 0


def cmd_write(path: Path) -> int:
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--exclude", PROJECT],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pins = [line for line in frozen.splitlines() if line.strip()]
    bad = [line for line in pins if not PIN.match(line)]
    if bad:
        raise SystemExit(f"pip freeze gave lines that are not name==version: {bad}")
    names = {canonical(PIN.match(line)[1]) for line in pins}
    missing = {"pip", "setuptools"} - names
    if missing:
        raise SystemExit(f"the environment lacks {sorted(missing)}: a lock needs them")
    version = sys.version_info
    header = HEADER.format(
        minor=f"{version.major}.{version.minor}",
        full=f"{version.major}.{version.minor}.{version.micro}",
        platform=sys.platform,
    )
    path.write_text(header + "\n".join(pins) + "\n")
    print(f"wrote {path}: {len(pins)} packages for Python {version.major}.{version.minor}")
    return 0


def cmd_versions(names: list[str]) -> int:
    have = installed()
    print(", ".join(f"{n} {have.get(canonical(n), (n, 'not installed'))[1]}" for n in names))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("check-python", "exit 1 unless this Python's minor is the lock's"),
        ("verify", "exit 1 unless this environment is exactly the lock"),
        ("diff", "print the packages whose versions differ from the lock"),
        ("write", "freeze this environment into the lock file"),
    ]:
        commands.add_parser(name, help=text).add_argument("lock", type=Path)
    versions = commands.add_parser("versions", help="print installed versions")
    versions.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "versions":
        return cmd_versions(args.names)
    if args.command != "write" and not args.lock.is_file():
        print(f"error: no lock file {args.lock}", file=sys.stderr)
        return 1
    handler = {
        "check-python": cmd_check_python,
        "verify": cmd_verify,
        "diff": cmd_diff,
        "write": cmd_write,
    }[args.command]
    return handler(args.lock)


if __name__ == "__main__":
    raise SystemExit(main())
