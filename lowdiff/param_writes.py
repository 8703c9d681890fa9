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
``FULL_EVERY``). The first write seen is reported once, and the checks stop.

Optimizer step hooks registered on the inner optimizer (or globally) run inside its ``step()``, after lowdiff took
the step's gradient and before it can look at the parameters: a pre-hook that scales gradients or a post-hook that
clamps weights changes what the run trains, and no replay runs it. :class:`HookWatch` says so once. Hooks on
lowdiff's own optimizer are handled by the wrapper instead (pre-hooks before the gradient is taken, post-hooks
after this watch is armed).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

log = logging.getLogger(__name__)

FULL_EVERY = 16
_version = attrgetter("_version")


class WriteWatch:
    """Watches ``named`` parameters for writes between the end of one ``opt.step()`` and the start of the next."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self._names = list(named)
        self._params = list(named.values())
        self._sentinels = [0, len(self._params) - 1] if len(self._params) > 2 else list(range(len(self._params)))
        self._seen: tuple[int, list[int], list[int]] | None = None
        """(the step armed at, indices of the parameters armed, their versions)."""
        self.reported = False

    def arm(self, step: int) -> None:
        """The parameters as ``opt.step()`` of ``step`` (or a resume at ``step``) left them: what the next
        :meth:`check` compares with. All of them when the next step is a full check's, else the sentinels."""
        if self.reported:
            return
        if (step + 1) % FULL_EVERY == 0:
            self._seen = step, list(range(len(self._params))), list(map(_version, self._params))
        else:
            self._seen = step, self._sentinels, [self._params[i]._version for i in self._sentinels]

    def check(self, step: int) -> list[str]:
        """At the start of ``opt.step()`` for ``step``: the armed parameters written since :meth:`arm` (at the last
        step: iterations a GradScaler skipped lie between), reported once (a warning naming them); [] when none was,
        or nothing was armed (an interrupted step, the first)."""
        seen, self._seen = self._seen, None
        if seen is None or self.reported:
            return []
        armed, indices, before = seen
        now = list(map(_version, self._params)) if len(indices) == len(self._params) else \
            [self._params[i]._version for i in indices]
        if now == before:
            return []
        changed = [self._names[i] for i, v, v0 in zip(indices, now, before) if v != v0]
        self.reported = True
        shown = ", ".join(repr(n) for n in changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        log.warning("lowdiff: parameter(s) %s changed between opt.step() %d and %d, outside the optimizer step: the "
                    "log holds optimizer steps only, so a state recovered or resumed after step %d will not have "
                    "this change (nor later ones like it). Make such changes inside the optimizer's step() (a "
                    "subclass that applies them after the update, replayed too: pass optimizer_class= to "
                    "lowdiff.recover()), or see 'Changes outside opt.step()' in docs/guide/exact-resume.md. Reported "
                    "once per run", shown, armed, step, armed)
        return changed


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
