"""Math answer matching: pull the final answer out of a completion and compare it with a reference.

Extraction, first rule that applies wins:

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

import math
import re
from fractions import Fraction

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


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the answer extracted from ``completion`` matches ``answer``, else 0.0."""
    try:
        predicted = extract_answer(completion)
        return 1.0 if predicted is not None and answers_match(predicted, answer) else 0.0
    except Exception:  # a reward function must never take a rollout worker down
        return 0.0
