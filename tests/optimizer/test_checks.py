"""The argument-check primitives (clipopt/_checks.py) and the messages of the checks built on them:
each names the argument, the value and the fix."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from clipopt import QKClip, Rerun, SpikeGuard
from clipopt._checks import check_float_between, check_names, check_positive_float


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (("b",), ("b",)),
        (["c", "a"], ("c", "a")),  # a list is taken, in the order given
        (("a", "b", "c"), ("a", "b", "c")),
    ],
)
def test_check_names_takes_each_name_once_in_the_order_given(value: Any, want: tuple[str, ...]) -> None:
    assert check_names("on", value, ("a", "b", "c")) == want


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ("a", TypeError, "on must be a tuple of names from ('a', 'b'), got 'a'; pass e.g. on=('a',)"),
        (3, TypeError, "on must be a tuple of names from ('a', 'b'), got 3; pass e.g. on=('a',)"),
        (
            (),
            ValueError,
            "on must name each of ('a', 'b') at most once, and at least one, got (); pass e.g. on=('a',)",
        ),
        (
            ("a", "z"),
            ValueError,
            "on must name each of ('a', 'b') at most once, and at least one, got ('a', 'z')",
        ),
        (
            ("b", "b"),
            ValueError,
            "on must name each of ('a', 'b') at most once, and at least one, got ('b', 'b')",
        ),
        ((["a"],), ValueError, "got (['a'],); pass e.g. on=('a',)"),  # unhashable: refused, not a crash
    ],
)
def test_check_names_refuses_naming_the_argument_the_value_and_the_fix(
    value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        check_names("on", value, ("a", "b"), "('a',)")


def test_check_names_suggests_every_name_when_given_no_example() -> None:
    with pytest.raises(ValueError, match=re.escape("; pass e.g. on=('a', 'b')")):
        check_names("on", ("z",), ("a", "b"))


@pytest.mark.parametrize(
    ("value", "open_high", "error", "message"),
    [
        (1.5, False, ValueError, "alpha must be in [0, 1], got 1.5; pass e.g. alpha=0.5"),
        (float("nan"), False, ValueError, "alpha must be in [0, 1], got nan"),
        (True, False, TypeError, "alpha must be a float in [0, 1], got True (bool); pass e.g. alpha=0.5"),
        (1.0, True, ValueError, "alpha must be in [0, 1), got 1.0; pass e.g. alpha=0.5"),
        ("0.5", True, TypeError, "alpha must be a float in [0, 1), got '0.5' (str); pass e.g. alpha=0.5"),
    ],
)
def test_check_float_between_refuses_outside_its_interval(
    value: Any, open_high: bool, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        check_float_between("alpha", value, 0.0, 1.0, "0.5", open_high=open_high)


def test_check_float_between_takes_its_ends_as_asked() -> None:
    assert check_float_between("alpha", 0, 0.0, 1.0, "0.5") == 0.0
    assert check_float_between("alpha", 1, 0.0, 1.0, "0.5") == 1.0
    assert check_float_between("alpha", 0.0, 0.0, 1.0, "0.5", open_high=True) == 0.0


@pytest.mark.parametrize(
    ("value", "error"), [(0.0, ValueError), (float("inf"), ValueError), ("1", TypeError)]
)
def test_check_positive_float_never_offers_none_for_an_argument_that_refuses_it(
    value: Any, error: type[Exception]
) -> None:
    """(It said 'or eps=None to turn it off' for arguments whose None is a TypeError.)"""
    with pytest.raises(error) as info:
        check_positive_float("eps", value, "1e-8")
    assert "None" not in str(info.value) and str(info.value).endswith("; pass e.g. eps=1e-8")
    with pytest.raises(
        TypeError, match=re.escape("eps must be a positive float, got None; pass e.g. eps=1e-8")
    ):
        check_positive_float("eps", None, "1e-8")


def test_check_positive_float_puts_its_hint_after_the_example() -> None:
    with pytest.raises(
        ValueError, match=re.escape("x must be a positive finite number, got -1; pass e.g. x=2.0 (why)")
    ):
        check_positive_float("x", -1, "2.0", "why")


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda m: QKClip(m, threshold=0.0),
            ValueError,
            "threshold must be a positive finite number, got 0.0; pass e.g. threshold=100.0 "
            "(the largest attention logit left alone; Kimi K2 and Megatron-LM use 100)",
        ),
        (
            lambda m: QKClip(m, threshold="100"),
            TypeError,
            "threshold must be a positive float, got '100' (str); pass e.g. threshold=100.0 (",
        ),
        (
            lambda m: QKClip(m, alpha=1.5),
            ValueError,
            "alpha must be in [0, 1], got 1.5; pass e.g. alpha=0.5 (the query rows take eta**alpha of the "
            "cap, the key rows eta**(1 - alpha): 0.5, an even split)",
        ),
        (
            lambda m: QKClip(m, alpha=None),
            TypeError,
            "alpha must be a float in [0, 1], got None (NoneType); pass e.g.",
        ),
        (
            lambda m: SpikeGuard(signals=["loss", "loss"]),
            ValueError,
            "signals must name each of ('loss', 'grad_norm') at most once, and at least one, "
            "got ['loss', 'loss']; pass e.g. signals=('grad_norm',)",
        ),
        (
            lambda m: Rerun(on="spike"),
            TypeError,
            "on must be a tuple of names from ('nonfinite', 'spike'), got 'spike'; "
            "pass e.g. on=('nonfinite',)",
        ),
    ],
)
def test_the_checks_built_on_the_primitives_name_the_argument_the_value_and_the_fix(
    make: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        make(torch.nn.MultiheadAttention(8, 2))


def test_a_guard_stores_its_signals_in_their_own_order() -> None:
    """check_names keeps the order given; the guard stores its signals in SIGNALS's order, as before."""
    assert SpikeGuard(signals=("grad_norm", "loss")).signals == ("loss", "grad_norm")
    assert Rerun(on=("spike", "nonfinite")).on == ("spike", "nonfinite")
