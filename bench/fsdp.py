"""FSDP2 (fully_shard) benchmark: per-rank bytes written per step at world sizes 1 and 2 for each compressor (each
rank logs its own shards: about 1/N of one process's log), and the 2-rank overhead of per-iteration checkpointing
over the same fully_shard training with `enabled: false`. bench/ddp.py's benchmark, same model and protocol, with
each transformer block and the root ``fully_shard``-ed instead of wrapped in DDP.

Each configuration is one torchrun job (gloo, CPU, one thread per rank). Inside the overhead job the two modes
alternate round by round (a fresh model, fully_shard and run directory per round), so machine drift hits both
alike; the ratio is of medians of per-round median step times.

    python bench/fsdp.py            # bench/results/fsdp.json + docs/measurements/fsdp.md
    python bench/fsdp.py --smoke    # seconds
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp import main  # noqa: E402

if __name__ == "__main__":
    main("fsdp", __doc__)
