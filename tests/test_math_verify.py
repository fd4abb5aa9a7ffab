"""The built-in math reward (``pipeline_rl.tasks.math_reward``): math-verify (the ``math``
extra) against the hand-written matcher it replaced, which stays as the fallback, on a
table of GSM8K- and MATH-style answers (fractions, ``\\frac``, ``\\boxed{}``, units,
equivalent expressions). Each row: a completion, the reference answer, and whether the
completion is right. The counts the table gives are asserted (and printed) below.
"""

from __future__ import annotations

import pytest

from pipeline_rl.tasks import math_reward as mr

#: (completion, reference answer, is the completion right?)
CASES = [
    # GSM8K style
    ("She has 3 + 4 = 7 apples.\n#### 7", "Natalia sold 48/2 = 24 clips.\n#### 7", True),
    ("The answer is 72.", "#### 72", True),
    ("So the total is $1,000.", "1000", True),
    ("The total cost is $18.00", "18", True),
    ("He walks 5 km each day, so 35 km in total.", "35", True),
    ("The answer is 36 cm^2", "36", True),
    ("That leaves 12 eggs. #### 12", "#### 13", False),
    ("The answer is 0.5", "1/2", True),
    ("The answer is 50%", "0.5", True),
    ("Final answer: 3 hours", "180", False),
    ("The answer is -4", "4", False),
    # MATH style
    ("Thus $\\boxed{\\frac{1}{2}}$.", "\\boxed{\\frac{1}{2}}", True),
    ("So we get $\\boxed{0.5}$.", "$\\frac12$", True),
    ("$\\boxed{\\dfrac{3}{4}}$", "\\frac{3}{4}", True),
    ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", True),
    ("$\\boxed{x^2+2x+1}$", "(x+1)^2", True),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt3}{2}", True),
    ("$\\boxed{\\pi/2}$", "\\frac{\\pi}{2}", True),
    ("$\\boxed{(1,2)}$", "(1, 2)", True),
    ("$\\boxed{[0, 1)}$", "[0,1)", True),
    ("$\\boxed{\\{1,2,3\\}}$", "\\{3,2,1\\}", True),
    ("The roots are $\\boxed{2, 3}$.", "3, 2", True),
    ("$\\boxed{x = 5}$", "5", True),
    ("$\\boxed{90^\\circ}$", "90", True),
    ("$\\boxed{\\text{(B)}}$", "\\text{(B)}", True),
    ("$\\boxed{1.5}$", "\\frac{3}{2}", True),
    ("$\\boxed{\\frac{2}{4}}$", "\\frac{1}{2}", True),
    ("$\\boxed{3\\sqrt{2}}$", "\\sqrt{18}", True),
    ("$\\boxed{\\frac{1}{3}}$", "0.3333", False),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{3}", False),
    ("$\\boxed{2x+1}$", "2x-1", False),
    ("$\\boxed{10\\%}$", "10", True),
    ("$\\boxed{5\\text{ cm}}$", "5", True),
    ("$\\boxed{e^{i\\pi}}$", "-1", True),
    ("$\\boxed{\\sqrt{2}}$", "1.414", False),
    ("1e999", "1", False),                 # math-verify would read 1: the fallback scores it
]

#: Rows math-verify gets wrong (``e^{i\pi}`` is not evaluated to -1).
MATH_VERIFY_WRONG = {"$\\boxed{e^{i\\pi}}$"}
#: How many rows the hand-written matcher gets wrong where math-verify is right.
OLD_WRONG = 11


@pytest.fixture
def math_verify() -> None:
    """The suite's install (``scripts/setup.sh --dev``) includes the math extra: a missing
    math-verify is a broken install, not a reason to skip."""
    assert mr._math_verify() is not None, "math-verify is not installed: the dev install includes the math extra"


def test_math_verify_is_right_where_the_old_matcher_was_not(math_verify: None,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    both, only_new, only_old, neither = [], [], [], []
    for completion, reference, right in CASES:
        new = (mr.math_reward(completion, reference) == 1.0) == right
        old = (mr.fallback_reward(completion, reference) == 1.0) == right
        (both if new and old else only_new if new else only_old if old else neither).append(completion)
    with capsys.disabled():
        print(f"\nmath table: {len(CASES)} rows; both right {len(both)}, math-verify only {len(only_new)}, "
              f"the old matcher only {len(only_old)}, neither {len(neither)}")
    assert not only_old                                   # never worse than the matcher it replaced
    assert set(neither) == MATH_VERIFY_WRONG
    assert len(only_new) == OLD_WRONG and len(both) == len(CASES) - OLD_WRONG - len(neither)


def test_risky_answers_fall_back_instead_of_hanging(math_verify: None) -> None:
    """SymPy would not return on a tower of powers: the hand-written matcher scores it."""
    assert mr.verified_reward("\\boxed{9^{9^{9^{9}}}}", "3") is None
    assert mr.math_reward("\\boxed{9^{9^{9^{9}}}}", "3") == 0.0
    assert mr.verified_reward("so 100! ways", "5") is None


def test_without_the_extra_the_old_matcher_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mr, "_math_verify", lambda: None)
    assert mr.backend() == "math answers: the built-in matcher (pip install -e .[math] for math-verify)"
    assert mr.math_reward("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}") == 0.0      # what math-verify gets right
    assert mr.math_reward("So the total is $1,000.", "#### 1000") == 1.0


def test_backend_names_math_verify_and_its_version(math_verify: None) -> None:
    from importlib.metadata import version

    assert mr.backend() == f"math answers: math-verify {version('math-verify')}"
