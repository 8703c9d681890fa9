"""Parameters written between two ``opt.step()`` calls: changes the log does not hold.

Recovery rebuilds parameters by replaying optimizer steps. A loop that also writes them itself between steps
(weight clipping or a max-norm constraint after the step, weights loaded into the model, an EMA copied over them)
trains a state no replay reaches: recovery past that point returns parameters without the change. lowdiff cannot
log such writes, but it can see most of them and say so at once instead of at a recovery: an in-place write through
the parameter itself (under ``torch.no_grad()``, through ``detach()``, ``load_state_dict``'s ``copy_``) bumps its
version counter. A write through ``param.data`` (``p.data.clamp_()``, ``p.data = t``) does not, and is not seen
(docs/guide/exact-resume.md says what to do instead).

The check compares version counters at the start of an ``opt.step()`` with those the previous one left. Reading one
costs about 0.1 us (torch's attribute access), 20 us for 200 parameters, twice a step: too much on a fast step for
every parameter every step. So every step checks two sentinels (the first and the last parameter: a loop over the
model's parameters or a ``load_state_dict`` writes them too), and one step in ``FULL_EVERY`` checks them all (a write
to some layers only, done every step, is seen within that many steps; done once, it is seen with a chance of one in
``FULL_EVERY``). The sentinels' optimizer state is watched too (its tensors' version counters and identities: Adam's
moments reset or zeroed in a loop over the state, a rollback through the inner optimizer's ``load_state_dict()``);
an edit of other parameters' state alone is not seen. The first write seen is reported once, and the checks stop.

Optimizer step hooks registered on the inner optimizer (or globally) run inside its ``step()``, after lowdiff took
the step's gradient and before it can look at the parameters: a pre-hook that scales gradients or a post-hook that
clamps weights changes what the run trains, and no replay runs it. :class:`HookWatch` says so once. Hooks on
lowdiff's own optimizer are handled by the wrapper instead (pre-hooks before the gradient is taken, post-hooks
after this watch is armed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from lowdiff.errors import ModelMismatchError

log = logging.getLogger(__name__)

FULL_EVERY = 16


class WriteWatch:
    """Watches ``named`` parameters, and with ``optimizer`` their state in it, for writes between the end of one
    ``opt.step()`` and the start of the next."""

    def __init__(self, named: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> None:
        self._names = list(named)
        self._params = list(named.values())
        self._optimizer = optimizer
        self._sentinels = [0, len(self._params) - 1] if len(self._params) > 2 else list(range(len(self._params)))
        self._kinds = [(self._params[i].dtype, self._params[i].shape) for i in self._sentinels]
        self._seen: tuple[int, list[int], list[int], list[tuple[Any, ...]]] | None = None
        """(the step armed at, indices of the parameters armed, their versions, their optimizer state's marks)."""
        self.reported = False

    def _marks(self, indices: list[int]) -> list[tuple[Any, ...]]:
        if self._optimizer is None:
            return []
        state = self._optimizer.state  # looked up each time: load_state_dict() replaces the mapping
        return [_state_mark(state.get(self._params[i])) for i in indices]

    def arm(self, step: int) -> None:
        """The parameters as ``opt.step()`` of ``step`` (or a resume at ``step``) left them: what the next
        :meth:`check` compares with. All of them when the next step is a full check's, else the sentinels."""
        if self.reported:
            return
        indices = list(range(len(self._params))) if (step + 1) % FULL_EVERY == 0 else self._sentinels
        # The optimizer state of the sentinels only: marking every parameter's state cost 35 us a step on faststep's
        # 192 parameters (one step in 16), the sentinels' 3 us; a reset, a rollback or a loop over the state sees them.
        self._seen = step, indices, [self._params[i]._version for i in indices], self._marks(self._sentinels)

    def check(self, step: int) -> list[str]:
        """At the start of ``opt.step()`` for ``step``: the armed parameters written since :meth:`arm` (at the last
        step: iterations a GradScaler skipped lie between), or whose optimizer state was, reported once (a warning
        naming them); [] when none was, or nothing was armed (an interrupted step, the first)."""
        for i, (dtype, shape) in zip(self._sentinels, self._kinds):
            p = self._params[i]
            if p.dtype != dtype or p.shape != shape:
                # model.to(dtype) after wrap() replaces .data (no version bump): every file from here on would hold
                # tensors the manifest does not describe, and recovery would refuse them all as damaged.
                raise ModelMismatchError(
                    f"parameter {self._names[i]!r} is {str(p.dtype).removeprefix('torch.')}{list(p.shape)} at "
                    f"opt.step() {step}, but lowdiff.wrap() recorded it as {str(dtype).removeprefix('torch.')}"
                    f"{list(shape)} (the model was cast or reshaped after wrap()): cast the model before building "
                    "its optimizer and wrapping it, or start a new run directory for the new model")
        seen, self._seen = self._seen, None
        if seen is None or self.reported:
            return []
        armed, indices, before, marks = seen
        now = [self._params[i]._version for i in indices]
        marks_now = self._marks(self._sentinels)
        if now == before and marks_now == marks:
            return []
        written = [self._names[i] for i, v, v0 in zip(indices, now, before) if v != v0]
        state = [self._names[i] for i, m, m0 in zip(self._sentinels, marks_now, marks) if m != m0]
        self.reported = True
        what = []
        if written:
            what.append(f"parameter(s) {_shown(written)}")
        if state:
            what.append(f"the optimizer state of parameter(s) {_shown(state)}")
        log.warning("lowdiff: %s changed between opt.step() %d and %d, outside the optimizer step: the log holds "
                    "optimizer steps only, so a state recovered or resumed after step %d will not have this change "
                    "(nor later ones like it). Make such changes inside the optimizer's step() (a subclass that "
                    "applies them after the update, replayed too: pass optimizer_class= to lowdiff.recover()), or "
                    "see 'Changes outside opt.step()' in docs/guide/exact-resume.md. Reported once",
                    " and ".join(what), armed, step, armed)
        return written + [n for n in state if n not in written]


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _state_mark(st: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What changes when a parameter's optimizer state is written in place (a tensor's version counter), replaced
    (``load_state_dict`` makes new tensors: a new id, version 0 where the old one had been stepped) or removed
    (``state.clear()``)."""
    if not st:
        return ()
    return tuple((k, id(v), v._version) if isinstance(v, torch.Tensor) else (k, _plain(v)) for k, v in st.items())


def _plain(v: Any) -> Any:
    """A non-tensor state value, comparable with ``==`` and equal to itself: numbers by their repr (a NaN stays equal
    to itself), other objects (a list of tensors in some optimizer's state) by identity, never element by element."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    return id(v)


class HookWatch:
    """Step hooks that run inside the inner optimizer's ``step()`` (its own, and global ones other than torch's
    observers, such as torch.profiler's): reported once, at the first step that finds any. The registries are looked
    into again only when their sizes change, so a step costs four ``len()`` calls."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self._inner = inner
        self._sizes: tuple[int, ...] | None = None
        self.reported: list[str] = []

    def check(self, step: int) -> list[str]:
        if self.reported:
            return []
        inner = self._inner
        pre, post = getattr(inner, "_optimizer_step_pre_hooks", {}), getattr(inner, "_optimizer_step_post_hooks", {})
        sizes = (len(pre), len(post), len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
        if sizes == self._sizes:
            return []
        self._sizes = sizes
        found = [f"pre-hook {_name(h)!r}" for h in pre.values()] + [f"post-hook {_name(h)!r}" for h in post.values()]
        found += [f"global pre-hook {_name(h)!r}" for h in _global_optimizer_pre_hooks.values() if not _torchs(h)]
        found += [f"global post-hook {_name(h)!r}" for h in _global_optimizer_post_hooks.values() if not _torchs(h)]
        if not found:
            return []
        self.reported = found
        log.warning("lowdiff: optimizer step hook(s) %s run inside the inner optimizer's step(), where lowdiff has "
                    "already taken step %d's gradient and cannot see what they change: recovery and resume replay "
                    "the steps without them. If a hook changes gradients, parameters or optimizer state, register "
                    "it on lowdiff's optimizer instead (opt.register_step_pre_hook: the gradient it leaves is the "
                    "one logged; opt.register_step_post_hook: writes to parameters are reported), or make the "
                    "change inside a subclass's step() (docs/guide/exact-resume.md, 'Changes outside opt.step()'). "
                    "A hook that only reads is harmless. Reported once", ", ".join(found[:4]), step)
        return found


def _name(hook: object) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def _torchs(hook: object) -> bool:
    """torch's own observers (torch.profiler registers a global post-hook when imported): they change nothing."""
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "torch"
