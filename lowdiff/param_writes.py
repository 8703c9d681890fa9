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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from operator import attrgetter

import torch

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
