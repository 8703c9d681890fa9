"""Layer 5, persistence (internal): the checkpointer and its snapshot policies (fixed, or the tuner's), the
writers that commit step records and snapshots through the run directory (a thread, ``thread_writer.py``, or a
process of its own, ``process_writer.py`` on the trainer's side and ``child.py`` in the persistence process,
talking in the messages of ``messages.py``), the shadow replica, and the coordination of sharded writes.

Reads and writes the format (``lowdiff._storage``) and replays steps into the shadow replica with recovery's
kernels; never imports the training side."""
