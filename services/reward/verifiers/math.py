"""Numeric and symbolic answer equivalence (`math_equiv`).

Outcome rule (the trainer masks ERROR/TIMEOUT items and learns from every OK one):
- the response has no answer we can parse -> OK, reward 0.0, component `parsed` = 0 (a
  wrong answer, not a broken verifier);
- the *reference* cannot be parsed, or metadata is malformed -> the verifier raises, so the
  item is ERROR (the task is broken; a 0 would teach the model that the right answer is wrong);
- sympy running past the service's deadline -> TIMEOUT (the scorer's deadline runner).

Comparison: answers are exact (`1/2`, `sqrt(8)`) unless a decimal literal appears (`0.5`),
in which case they are compared numerically with `rel_tol` (default 1e-9) and `abs_tol`
(default 1e-12); a `rel_tol`/`abs_tol` in metadata applies to every comparison. Exact
rationals compare exactly. Other expressions are evaluated at 50 significant digits (at a few
fixed pseudo-random points when they have symbols), and `simplify` is the fallback when they
cannot be evaluated there. Tuples compare in order, sets in any order.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from services.reward.verifiers.base import Verdict
from services.reward.verifiers.extract import answer_candidates, last_boxed
from services.reward.verifiers.latex import latex_to_plain
from services.reward.verifiers.mathparse import MAX_CHARS, Parsed, ParseError, Seq, Value, parse_plain
from services.reward.verifiers.numeric import Evaluator, TooLarge

DEFAULT_REL_TOL = 1e-9
DEFAULT_ABS_TOL = 1e-12
NUM_PROBES = 6
MIN_AGREEING_PROBES = 3
MAX_SIMPLIFY_OPS = 200
MAX_LATEX_CHARS = 4 * MAX_CHARS

_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    rel: float
    abs: float


# For exact answers: only evaluation noise at 50 digits is forgiven.
STRICT = Tolerance(rel=1e-30, abs=1e-30)
APPROXIMATE = Tolerance(rel=DEFAULT_REL_TOL, abs=DEFAULT_ABS_TOL)


def tolerance_from(metadata: Mapping[str, Any]) -> Tolerance | None:
    """The tolerance metadata asks for (`rel_tol`, `abs_tol`), else None; ValueError if malformed."""
    if "rel_tol" not in metadata and "abs_tol" not in metadata:
        return None
    values = {}
    for key, default in (("rel_tol", DEFAULT_REL_TOL), ("abs_tol", DEFAULT_ABS_TOL)):
        value = metadata.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ValueError(f"metadata {key} must be a finite number >= 0, got {value!r}")
        values[key] = float(value)
    return Tolerance(rel=values["rel_tol"], abs=values["abs_tol"])


def parse_answer(text: str) -> Parsed:
    """One answer, LaTeX or plain (`\\frac{1}{2}`, `1/2`, `0.5`, `1,000`); ParseError if it is not one."""
    text = text.strip()
    if len(text) > MAX_LATEX_CHARS:
        raise ParseError(f"answer is longer than {MAX_LATEX_CHARS} characters")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return parse_plain(latex_to_plain(text))


def _close(a: Any, b: Any, tol: Tolerance) -> bool:
    return bool(abs(a - b) <= max(tol.abs, tol.rel * max(abs(a), abs(b))))


def _simplifies_to_zero(diff: sympy.Expr) -> bool:
    if sympy.count_ops(diff) > MAX_SIMPLIFY_OPS:
        return False
    try:
        return bool(sympy.simplify(diff) == 0)
    except (ArithmeticError, ValueError, TypeError, RecursionError):
        return False


def _probe_points(symbols: list[sympy.Symbol]) -> list[dict[sympy.Symbol, sympy.Rational]]:
    # Fixed seed: the same pair always gets the same verdict. Rationals p/97 of both signs
    # avoid the special points (0, +-1, multiples of pi) where different functions agree.
    rng = random.Random(97)
    return [{s: sympy.Rational(rng.choice((-1, 1)) * rng.randint(20, 290), 97) for s in symbols}
            for _ in range(NUM_PROBES)]


def expressions_equal(a: sympy.Expr, b: sympy.Expr, tol: Tolerance, *, exact: bool,
                      evaluate: Evaluator) -> bool:
    """Equal structurally, else numerically at fixed points; `simplify` only where neither is defined."""
    diff = a - b
    if a == b or diff == 0:
        return True
    if exact and diff.is_Rational:  # sympy cancelled all the rest (e^1000+1 vs e^1000): exactly not equal
        return False
    if a.has(sympy.oo, -sympy.oo, sympy.zoo) or b.has(sympy.oo, -sympy.oo, sympy.zoo):
        return False  # structurally different infinities
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    agreeing = 0
    try:
        for point in _probe_points(symbols) if symbols else [{}]:
            va, vb = evaluate(a, point), evaluate(b, point)
            if va is None or vb is None:
                continue
            if not _close(va, vb, tol):
                return False
            agreeing += 1
    except TooLarge:
        return False  # too large to evaluate and not structurally equal: not worth a hung thread
    if agreeing >= (MIN_AGREEING_PROBES if symbols else 1):
        return True
    return _simplifies_to_zero(diff)


def values_equal(a: Value, b: Value, tol: Tolerance, *, exact: bool, evaluate: Evaluator) -> bool:
    """Scalars by `expressions_equal`; tuples item by item in order; sets as sets."""
    if isinstance(a, Seq) or isinstance(b, Seq):
        if not (isinstance(a, Seq) and isinstance(b, Seq)) or a.kind != b.kind:
            return False

        def same(x: Value, y: Value) -> bool:
            return values_equal(x, y, tol, exact=exact, evaluate=evaluate)

        if a.kind == "tuple":
            return len(a.items) == len(b.items) and all(same(x, y) for x, y in zip(a.items, b.items, strict=True))
        return (all(any(same(x, y) for y in b.items) for x in a.items)
                and all(any(same(x, y) for x in a.items) for y in b.items))
    return expressions_equal(a, b, tol, exact=exact, evaluate=evaluate)


def equivalent(got: Parsed, want: Parsed, tol: Tolerance | None = None) -> bool:
    """Whether two parsed answers are the same; `tol` (from metadata) overrides the defaults."""
    approximate = got.approximate or want.approximate
    effective = tol or (APPROXIMATE if approximate else STRICT)
    return values_equal(got.value, want.value, effective, exact=tol is None and not approximate,
                        evaluate=Evaluator())


def parse_reference(reference: str) -> Parsed:
    """The reference answer (its \\boxed{} content when it has one); ValueError names the problem."""
    boxed = last_boxed(reference)
    try:
        return parse_answer(boxed if boxed is not None else reference)
    except ParseError as e:
        raise ValueError(f"reference answer {reference[:200]!r} cannot be parsed: {e}") from None


def math_equiv(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    tol = tolerance_from(metadata)
    extract = metadata.get("extract", True)
    if not isinstance(extract, bool):
        raise ValueError(f"metadata extract must be true or false, got {extract!r}")
    want = parse_reference(reference)
    for candidate in answer_candidates(response) if extract else [response]:
        try:
            got = parse_answer(candidate)
        except ParseError:
            continue
        score = 1.0 if equivalent(got, want, tol) else 0.0
        return Verdict(reward=score, components={"parsed": 1.0, "math_equiv": score})
    return Verdict(reward=0.0, components={"parsed": 0.0, "math_equiv": 0.0})
