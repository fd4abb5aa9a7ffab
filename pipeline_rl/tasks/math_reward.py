"""Math answer matching: pull the final answer out of a completion and compare it with a reference.

With the ``math`` extra installed (``pip install -e .[math]``: Hugging Face's
``math-verify``), :func:`math_reward` uses it: the answer extraction it provides (the last
``\\boxed{}``, LaTeX, plain expressions and numbers) and equivalence through SymPy
(``\\frac{1}{2}`` = ``0.5``, ``2\\sqrt{2}`` = ``\\sqrt{8}``, ``x^2+2x+1`` = ``(x+1)^2``).
A reference answer is read as below (after the last ``####``, else as written; a bare one
as if in ``\\boxed{}``). Its
timeouts use ``signal.alarm``, which works in the main thread only, so they are off
here; instead, an answer SymPy could spend unbounded time on (stacked exponents, a
factorial, a number of 40 or more digits), or that math-verify misreads (scientific
notation), is compared by the hand-written matcher below. :func:`backend` says which is
used (the driver logs it, one line).

Without the extra, or when math-verify finds no answer in the reference, the
hand-written matcher. Extraction, first rule that applies wins:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the text after the last ``####`` (GSM8K style), up to the end of that line;
3. the text after the last "answer is" / "answer:" (case-insensitive), up to the end of the sentence;
4. the last number in the completion.

A reference answer may be a whole solution: GSM8K style (``... #### 72``, the
text after the last ``####``) or MATH style (the last ``\\boxed{...}``).

Comparison: both sides are normalised (LaTeX spacing and ``\\left``/``\\right``,
``$``, ``\\text{}``, ``\\dfrac``/``\\tfrac``, trailing periods, units of degrees,
thousands separators); when both parse as numbers (integers, decimals,
fractions ``a/b`` or ``\\frac{a}{b}``, percentages as their number) they are equal
when the values agree to a relative 1e-6; otherwise the normalised strings must
be identical. The reward is 1.0 for a match, else 0.0. Nothing here raises on
any input.
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any, Callable

from pipeline_rl.tasks.base import strip_eos

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_FRAC_SHORT = re.compile(r"^(-?)\\frac(\d)(\d)$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _last_braced(text: str, command: str) -> str | None:
    """Content of the last ``\\command{...}`` with balanced braces, or None."""
    start = text.rfind("\\" + command + "{")
    if start < 0:
        return None
    i = start + len(command) + 2
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer stated in ``completion`` (see module doc for the rules), or None."""
    for command in ("boxed", "fbox"):
        boxed = _last_braced(completion, command)
        if boxed is not None:
            return boxed
    if "####" in completion:
        tail = completion.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    said = list(_ANSWER_IS.finditer(completion))
    if said:
        tail = completion[said[-1].end():].strip()
        line = tail.splitlines()[0] if tail else ""
        line = re.split(r"(?<!\d)\.(?!\d)|\.\s", line, maxsplit=1)[0].strip()
        if line:
            return line
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """Canonical string form of an answer (module doc lists what is removed)."""
    s = answer.strip()
    if "####" in s:  # a GSM8K-style reference solution: the answer follows the last ####
        tail = s.rsplit("####", 1)[1].strip()
        s = tail.splitlines()[0] if tail else ""
    boxed = _last_braced(s, "boxed")
    if boxed is not None:
        s = boxed
    s = _TEXT.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""),
                     ("\\ ", ""), ("$", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", "%")):
        s = s.replace(old, new)
    s = s.strip().rstrip(".").strip()
    if s.startswith("\\(") and s.endswith("\\)"):
        s = s[2:-2].strip()
    s = re.sub(r"\s+", "", s)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s.lower()


def to_number(answer: str) -> Fraction | float | None:
    """The numeric value of a normalised answer, or None when it is not a plain number."""
    s = answer[:-1] if answer.endswith("%") else answer
    frac = _FRAC.match(s) or _FRAC_SHORT.match(s)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?(?:/-?\d+)?|-?\.\d+", s):
            return Fraction(s)
        if re.fullmatch(r"-?(?:\d+\.?\d*|\.\d+)e-?\d+", s):
            value_f = float(s)
            return value_f if math.isfinite(value_f) else None
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """True when two answers are the same number (relative 1e-6) or the same normalised string."""
    p, r = normalize(predicted), normalize(reference)
    if not p:
        return False
    pn, rn = to_number(p), to_number(r)
    if pn is not None and rn is not None:
        if pn == rn:
            return True
        pf, rf = float(pn), float(rn)
        return math.isclose(pf, rf, rel_tol=1e-6, abs_tol=1e-9)
    return p == r


def fallback_reward(completion: str, answer: str) -> float:
    """The hand-written matcher: 1.0 when the answer extracted from ``completion``
    matches ``answer``, else 0.0."""
    try:
        predicted = extract_answer(completion)
        return 1.0 if predicted is not None and answers_match(predicted, answer) else 0.0
    except Exception:  # a reward function must never take a rollout worker down
        return 0.0


#: What SymPy may take unbounded time on (stacked exponents, a factorial, a huge number), and
#: what math-verify misreads (scientific notation: it takes ``1e999`` for 1).
_RISKY = re.compile(r"\^\s*\{?[^{}^]{0,20}\^|\d\s*!|\}\s*!|\d{40}|\d[eE][+-]?\d")


@functools.lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """math-verify's ``parse`` and ``verify``, or None without the extra."""
    try:
        import logging

        from math_verify import parse, verify
        for name in ("math_verify.parser", "math_verify.grader"):   # "timeout is disabled", said once
            logging.getLogger(name).setLevel(logging.ERROR)
    except ImportError:
        return None
    return parse, verify


def backend() -> str:
    """Which matcher :func:`math_reward` uses, as one line."""
    if _math_verify() is None:
        return "math answers: the built-in matcher (pip install -e .[math] for math-verify)"
    from importlib.metadata import version

    return f"math answers: math-verify {version('math-verify')}"


def _reference(answer: str) -> str:
    s = answer.strip()
    if "####" in s:
        tail = s.rsplit("####", 1)[1].strip()
        s = tail.splitlines()[0] if tail else ""
    return s


def verified_reward(completion: str, answer: str) -> float | None:
    """math-verify's verdict (1.0 or 0.0), or None when it cannot give one here (no
    extra, no answer found in the reference, a risky answer)."""
    mv = _math_verify()
    if mv is None:
        return None
    parse, verify = mv
    gold_text, text = _reference(answer), completion
    if _RISKY.search(gold_text) or _RISKY.search(text[-400:]):
        return None
    boxed = gold_text if "\\boxed" in gold_text or "$" in gold_text else f"\\boxed{{{gold_text}}}"
    gold = parse(boxed, parsing_timeout=None) or parse(gold_text, parsing_timeout=None)
    if not gold:
        return None
    pred = parse(text, parsing_timeout=None)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the answer in ``completion`` matches ``answer``, else 0.0: math-verify's
    verdict when it gives one, else the hand-written matcher's. Never raises."""
    try:
        verdict = verified_reward(strip_eos(completion), answer)
    except Exception:  # a reward function must never take a rollout worker down
        verdict = None
    return fallback_reward(completion, answer) if verdict is None else verdict
