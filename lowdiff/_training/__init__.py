"""Layer 6, the training side (internal): the optimizer wrapper ``lowdiff.wrap`` returns (``optimizer.py``: the
step), opening a run directory and resuming one (``opening.py``, ``resume.py``), the end of an iteration and what
``opt.track()`` registered (``iteration.py``), staging a step's record and snapshots (``stager.py``,
``capture.py``), DDP and FSDP2 glue (``ddp.py``, ``fsdp.py``), and the guards (parameter writes, hooks, signals,
interpreter exit: ``param_writes.py``, ``lifecycle.py``)."""
