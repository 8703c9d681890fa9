"""lowdiff._training.param_writes: the watch of parameters and optimizer state between two steps, on state an optimizer
other than torch's may keep (lists of tensors, NaN scalars) and on what it must report."""

from __future__ import annotations

import torch

from lowdiff._training.param_writes import WriteWatch


def _optimizer() -> tuple[torch.optim.Optimizer, torch.nn.Parameter, torch.nn.Parameter]:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([a, b], lr=0.1)
    opt.state[a] = {"history": [torch.zeros(2), torch.ones(2)], "rms": float("nan"), "count": 3}
    opt.state[b] = {"history": [torch.zeros(2)], "rms": float("nan"), "momentum": torch.zeros(3)}
    return opt, a, b


def test_state_an_optimizer_keeps_as_lists_and_nan_scalars_is_compared_without_error_or_false_report() -> None:
    """A list of tensors compared element by element raised (a tensor's truth value); NaN != NaN reported a change
    that never happened."""
    opt, a, b = _optimizer()
    watch = WriteWatch({"a": a, "b": b}, opt)
    for step in range(1, 40):  # full checks included
        watch.arm(step)
        opt.state[a]["rms"] = float("nan") * step  # a new NaN object each step, as an optimizer computing it makes
        assert watch.check(step + 1) == []
    watch.arm(40)
    opt.state[a]["history"] = [torch.zeros(2), torch.ones(2)]  # new tensors: a change, compared without raising
    assert watch.check(41) == ["a"]


def test_a_state_value_changed_between_steps_is_reported_once() -> None:
    opt, a, b = _optimizer()
    watch = WriteWatch({"a": a, "b": b}, opt)
    watch.arm(1)
    opt.state[b]["momentum"].mul_(0.0)
    assert watch.check(2) == ["b"]
    watch.arm(2)
    opt.state[a]["count"] = 4
    assert watch.check(3) == []  # reported once
