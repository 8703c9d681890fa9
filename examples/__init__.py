"""Examples for lowdiff; ``examples.tinygpt`` is also imported by the benchmarks (run from the repository root)."""
