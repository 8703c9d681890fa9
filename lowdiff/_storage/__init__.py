"""Layer 1, the on-disk format (internal): the spec in code (``format.py``), codecs, atomic commits, the HDF5
container, log segments and snapshots, the manifest, the run's history, locks, and the validation of untrusted
files. ``RunDir`` (``run_dir.py``) is the one object that knows a run directory's layout.

Imports nothing of lowdiff above it (only ``lowdiff.errors`` and ``lowdiff.config``'s leaves)."""
