"""The manifest's optimizer defaults as read from a run directory (lowdiff._storage.validate, FORMAT.md section 8):
what real optimizers are built with passes, shapes no optimizer has are refused."""

from __future__ import annotations

import pytest

from lowdiff._storage.format import encode_value
from lowdiff._storage.validate import check_group, decoded_defaults
from lowdiff.errors import CorruptFileError


def _enc(defaults: dict) -> dict:
    return {k: encode_value(v) for k, v in defaults.items()}


@pytest.mark.parametrize("defaults", [
    {"lr": 0.01, "eps": (None, 1e-3), "beta2_decay": -0.8, "d": 1.0, "weight_decay": 0.0},  # torch's Adafactor
    {"lr": None, "eps": (1e-30, 1e-3), "clip_threshold": 1.0, "beta1": None, "relative_step": True},  # transformers'
    {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False},
])
def test_real_optimizers_defaults_pass(defaults: dict) -> None:
    assert decoded_defaults(_enc(defaults), "manifest.json") == defaults


@pytest.mark.parametrize("bad", [
    {"lr": ()}, {"lr": (None,)}, {"weight_decay": (1.0, 2.0)}, {"eps": (None, None, None)}, {"eps": (None, -1.0)},
    {"betas": (0.9,)}, {"lr": -1.0}, {"lr": "abc"},
])
def test_shapes_no_optimizer_has_are_refused(bad: dict) -> None:
    with pytest.raises(CorruptFileError):
        decoded_defaults(_enc(bad), "manifest.json")


@pytest.mark.parametrize("group", [
    {"lr": float("nan"), "eps": (None, 1e-3)}, {"lr": -1.0, "eps": (None, 1e-3)}, {"lr": None, "eps": (-5.0, 1e-3)},
    {"lr": None, "eps": (float("inf"), 1e-3)},
])
def test_a_logged_number_where_the_default_is_none_is_checked_like_any_number(group: dict) -> None:
    """transformers' Adafactor is built with lr None and eps (None, 1e-3): a number a step logs there must still be
    finite and in range (FORMAT.md section 8); a forged NaN passed."""
    with pytest.raises(CorruptFileError, match="not a finite number"):
        check_group(group, {"lr": None, "eps": (None, 1e-3)}, "steps-0000000001-0000000001.h5")


def test_a_logged_group_of_real_adafactor_values_passes() -> None:
    check_group({"lr": 1e-2, "eps": (1e-30, 1e-3)}, {"lr": None, "eps": (None, 1e-3)}, "x.h5")
    check_group({"lr": None, "eps": (None, 1e-3)}, {"lr": None, "eps": (None, 1e-3)}, "x.h5")
