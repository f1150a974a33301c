"""The ``rh-dask`` application: the command line and what only it uses.

The library (:mod:`rh_dask`: the estimator, engines, distributed walk,
checkpoints) never imports this package. Here live the command line
(:mod:`.cli`), data readers and writers (:mod:`.io`, :mod:`.sizing`,
:mod:`.outputs`), the cluster a command runs on (:mod:`.cluster`), the fit
job (:mod:`.jobs`), reports and their plots (:mod:`.report`, :mod:`.plots`),
the demo (:mod:`.demo`) and the optional-dependency checks (:mod:`.extras`).
"""
