"""On-disk format: the spec in code (format.py), codecs, atomic commits, the HDF5 container, log and snapshots."""
