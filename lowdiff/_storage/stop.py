"""Stop files (format 2.5, docs/reference/FORMAT.md section 4a): the compressor memory a clean stop saves.

Error-feedback residuals cannot be rebuilt from the log, so a resume between two snapshots used to restart them at
zero. When a run stops cleanly (``opt.close()``, the SIGTERM path, interpreter exit) with the compressor's memory
at the last logged step S, the trainer writes ``stops/step-S.h5`` (one shard per rank under torch.distributed): the
compressor memory at S, and nothing else. A resume at exactly step S then continues bit for bit. The residuals are
the one part of the state the log lacks; a full snapshot at the stop would hold them too, but also the parameters
and the optimizer's state, four times the bytes with Adam, written in the grace period a scheduler gives a job
that is being stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowdiff._storage.container import ContainerReader, EntryIn, write_container
from lowdiff._storage.format import STOP_DIR, UNSHARDED, FileSet, Shard, dtype_name, parse_snapshot_name, snapshot_name
from lowdiff._storage.manifest import Manifest
from lowdiff._storage.snapshot import compressor_entry, rank_entry, rank_prefix, read_entry
from lowdiff._storage.tensors import COMPRESSOR_NAMES, check_compressor_tensor
from lowdiff._storage.validate import as_int, check_belongs, check_shard
from lowdiff.errors import CorruptFileError, ForeignFileError

KIND = "stop"


@dataclass
class StopState:
    """The compressor memory at ``step``: what every rank shares (PowerSGD's Q; everything in one process), and
    under torch.distributed one rank's own (its error-feedback residuals)."""

    step: int
    compressor_name: str
    compressor_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    rank_compressor_state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    ranks: int = 1
    """How many ranks wrote the set (its shards)."""


def write_stop(run_dir: Path, state: StopState, codec: str, shard: Shard = UNSHARDED, *, run_id: str | None = None,
               branch: str | None = None, direct: bool = True) -> int:
    """Commit this rank's shard of ``stops/step-S.h5``; returns the bytes written (``direct``: write_container's)."""
    entries = [EntryIn(f"compressor/{n}/{k}", [t], {"dtype": dtype_name(t.dtype), "shape": list(t.shape)})
               for n, st in state.compressor_state.items() for k, t in st.items()]
    if state.rank_compressor_state and shard.count < 2:
        raise ValueError("per-rank compressor state belongs in a sharded stop file (one shard per rank)")
    entries += [EntryIn(f"{rank_prefix(shard.index)}compressor/{n}/{k}", [t],
                        {"dtype": dtype_name(t.dtype), "shape": list(t.shape)})
                for n, st in state.rank_compressor_state.items() for k, t in st.items()]
    meta = {"step": state.step, "compressor": state.compressor_name, "shard": [shard.index, shard.count]}
    if run_id is not None:
        meta["run_id"] = run_id
    if branch is not None:
        meta["branch"] = branch
    return write_container(run_dir / STOP_DIR / snapshot_name(state.step, shard), KIND, meta, entries, codec,
                           direct=direct)


def read_stop(files: FileSet, manifest: Manifest, rank: int | None = None) -> StopState:
    """Read a stop file set, every file verified (checksums, that it belongs to this run and branch at its step,
    every tensor against the manifest); with ``rank``, also that rank's own memory from its shard. ``manifest``:
    the view of the set's layout (lowdiff._storage.layout.for_files)."""
    state: StopState | None = None
    seen: set[str] = set()
    for path in files.paths:
        try:
            with ContainerReader(path, KIND, confined=True) as r:
                state = _read_one(r, manifest, state, seen, rank)
        except CorruptFileError as e:
            e.path = e.path or path
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, OverflowError) as e:
            raise CorruptFileError(f"{path}: invalid stop file content ({e!r})", path=path) from e
    assert state is not None
    state.ranks = len(files.paths)
    return state


def _read_one(r: ContainerReader, manifest: Manifest, state: StopState | None, seen: set[str],
              rank: int | None) -> StopState:
    meta, path = r.meta, r.path
    step = as_int(meta.get("step"), str(path), "step")
    named = parse_snapshot_name(path.name)
    if named is not None:
        if named[0] != step:
            raise ForeignFileError(f"{path}: holds the compressor memory after step {step}, its name says step "
                                   f"{named[0]} (a file copied or renamed; remove it)", path=path, step=named[0])
        check_shard(meta, named[1].index, named[1].count, path)
    check_belongs(meta, manifest.run_id, path, manifest.history, (step, step))
    where = f"{path} (step {step})"
    if meta.get("compressor") not in COMPRESSOR_NAMES:
        raise CorruptFileError(f"{where}: unknown compressor {str(meta.get('compressor'))[:40]!r}")
    if state is None:
        state = StopState(step=step, compressor_name=meta["compressor"])
    elif (state.step, state.compressor_name) != (step, meta["compressor"]):
        raise CorruptFileError(f"{path}: shard holds step {step}, its sibling step {state.step} (or another "
                               "compressor)")
    shard = meta.get("shard") or [0, 1]
    optimized = set(manifest.optimized_params)
    for name, d in r.entries.items():
        if name in seen:
            raise CorruptFileError(f"{where}: entry {name!r} is also in a sibling shard")
        seen.add(name)
        kind, _, rest = name.partition("/")
        if kind == "rank":
            owner = rank_entry(rest, shard, where)
            pname, key, spec = compressor_entry(rest.split("/", 1)[1], optimized, manifest, where)
            if owner != rank:
                continue
            target = state.rank_compressor_state
        elif kind == "compressor":
            pname, key, spec = compressor_entry(rest, optimized, manifest, where)
            target = state.compressor_state
        else:
            raise CorruptFileError(f"{where}: unknown entry {name[:80]!r} (a stop file holds compressor memory only)")
        t = read_entry(r, name, d, max_numel=max(spec.numel, 1))
        check_compressor_tensor(t, spec, key, f"{where} [{name}]")
        target.setdefault(pname, {})[key] = t
    return state


def prune_stops(run_dir: Path, keep_step: int) -> list[Path]:
    """Delete the stop files of steps before ``keep_step`` (a stop serves only a resume at its own step, and the run
    has gone past theirs); returns the paths deleted."""
    gone: list[Path] = []
    directory = run_dir / STOP_DIR
    if not directory.is_dir():
        return gone
    for p in sorted(directory.iterdir()):
        parsed = parse_snapshot_name(p.name)
        if parsed is not None and parsed[0] < keep_step:
            try:
                p.unlink()
                gone.append(p)
            except FileNotFoundError:
                pass
    return gone


