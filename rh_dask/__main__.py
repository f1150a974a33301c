"""``python -m rh_dask``: the ``rh-dask`` command line (:mod:`rh_dask.app.cli`)."""

from .app.cli import main

# The guard matters: local clusters start worker processes that import __main__.
if __name__ == "__main__":
    raise SystemExit(main())
