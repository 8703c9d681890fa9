"""Layer 4, how bytes leave the training thread (internal): copies off the training device into host buffers
(``host_copies.py``: pinned memory on a GPU, pooled buffers on the CPU), a step packed into one buffer
(``packing.py``), and the shared-memory ring between the trainer and its persistence process (``ring.py``).

Knows nothing of checkpoints, writers or optimizers: it moves tensors."""
