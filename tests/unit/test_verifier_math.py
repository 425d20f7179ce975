"""math_equiv: LaTeX normalising, the eval-free parser, answer extraction, equivalence, outcomes.

Expected values are hand-checked. Pathological inputs must come back fast (refused or bounded),
not hang a verifier thread.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import sympy

from services.reward.runner import DeadlineRunner
from services.reward.scoring import Scorer, ScoreStatus
from services.reward.verifiers.base import Verdict
from services.reward.verifiers.extract import answer_candidates, last_boxed
from services.reward.verifiers.latex import latex_to_plain
from services.reward.verifiers.math import equivalent, math_equiv, parse_answer, tolerance_from
from services.reward.verifiers.mathparse import ParseError, Seq, parse_plain
from services.reward.verifiers.numeric import Evaluator, TooLarge

x = sympy.Symbol("x")


def right(score: float) -> Verdict:
    return Verdict(reward=score, components={"parsed": 1.0, "math_equiv": score})


UNPARSED = Verdict(reward=0.0, components={"parsed": 0.0, "math_equiv": 0.0})


@pytest.mark.parametrize(("latex", "plain"), [
    (r"\frac{1}{2}", "((1)/(2))"), (r"\dfrac12", "((1)/(2))"), (r"\tfrac{a}{b}", "((a)/(b))"),
    (r"\sqrt{8}", "sqrt(8)"), (r"\sqrt[3]{x}", "((x)^(1/(3)))"), (r"x^{2}", "x^(2)"),
    (r"\left(x+1\right)^2", "(x+1)^2"), (r"3 \cdot 4", "3 * 4"), (r"2\times 3", "2* 3"), (r"2\pi", "2 pi "),
    (r"\{1, 2\}", "\x011, 2\x02"), (r"{1, 2}", "\x011, 2\x02"), (r"90^\circ", "90"), (r"$5$", "5"),
    (r"5\ \text{cm}", "5  "), (r"\mathbf{7}", "(7)"), (r"1{,}000", "1000"), (r"50\%", "50%"), (r"x_{1}", "x_1"),
    ("3 − 1", "3 - 1"),
])
def test_latex_to_plain(latex: str, plain: str) -> None:
    assert latex_to_plain(latex) == plain


@pytest.mark.parametrize("latex", [r"\pm 2", r"x \le 3", r"\frac{1}", r"{1", r"1}", "\\", r"\int_0^1 x dx"])
def test_latex_outside_the_subset_is_refused_not_dropped(latex: str) -> None:
    with pytest.raises(ParseError):
        latex_to_plain(latex)


@pytest.mark.parametrize("latex", ["{" * 600 + "1" + "}" * 600, r"\sqrt" * 600 + "{2}", r"\frac{1}" * 400 + "{2}"])
def test_deep_latex_is_a_parse_error_not_a_recursion_error(latex: str) -> None:
    with pytest.raises(ParseError, match="nested"):
        latex_to_plain(latex)


@pytest.mark.parametrize(("text", "value"), [
    ("1/2", sympy.Rational(1, 2)), ("2x", 2 * x), ("2(x+1)", 2 * x + 2), ("-x^2", -x**2), ("2^3^2", 512),
    ("2^-1", sympy.Rational(1, 2)), ("2**3", 8), ("sin^2 x + cos^2 x", sympy.sin(x)**2 + sympy.cos(x)**2),
    ("sinx", sympy.sin(x)), ("e^x", sympy.exp(x)), ("ln(e)", 1), ("|x-1|", sympy.Abs(x - 1)), ("5!", 120),
    ("50%", sympy.Rational(1, 2)), ("1e-3", sympy.Rational(1, 1000)), ("x = 3", 3), ("i^2", -1),
    ("log(8, 2)", 3), ("sqrt 8", 2 * sympy.sqrt(2)),
])
def test_parse_plain(text: str, value: sympy.Expr) -> None:
    assert parse_plain(text).value == value


def test_parse_structures_and_approximation() -> None:
    assert parse_plain("(1, 2)").value == Seq(kind="tuple", items=(1, 2))
    assert parse_plain("\x011, 2\x02").value == Seq(kind="set", items=(1, 2))
    assert parse_plain("1, 2").value == Seq(kind="tuple", items=(1, 2))
    assert parse_plain("0.5").approximate and not parse_plain("1/2").approximate
    assert parse_plain("0.1").value == sympy.Rational(1, 10)  # exact, not the float 0.1000000000000000055


@pytest.mark.parametrize(("text", "why"), [
    ("9^9^9^9", "too large"), ("2^(10^9999)", "too large"), ("(10^9999)!", "factorial"), ("1/0", "undefined"),
    ("x2", "ambiguous"), ("abc", "word"), ("the answer", "word"), ("x^2 + y^2 = 1", "equation"),
    ("__import__('os')", "unexpected"), ("x.real", "unexpected"), ("1" * 201, "too large"),
    ("(" * 60 + "1" + ")" * 60, "nested"), ("+".join(["x"] * 300), "tokens"), ("x" * 1001, "longer"),
    ("sin^-1 x", "ambiguous"), ("", "empty"), ("(1, 2) + 1", "tuple"),
    # sympy factors huge integers for exact roots and logs: minutes, or forever.
    ("(10^10000+1)^(1/3)", "1024 bits"), ("sqrt(10^10000+1)", "1024 bits"), ("log(10^10000+1)", "1024 bits"),
    ("cosh(10^10000+1)", "1024 bits"), ("٣", "unexpected"), ("x" + "!" * 300, "nested factorials"),
])
def test_parse_refuses_unsafe_or_costly_input(text: str, why: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ParseError, match=why):
        parse_plain(text)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(("response", "candidates"), [
    (r"so \boxed{1} and finally \boxed{\frac{1}{2}}.", [r"\frac{1}{2}"]),
    (r"\boxed{\{1, \{2\}\}}", [r"\{1, \{2\}\}"]),
    ("<think>7?</think><answer>It is 12.</answer>", ["It is 12", "12"]),
    ("We compute... The final answer is: 3/4.", ["3/4"]),
    ("Answer: x^2 + 1", ["x^2 + 1", "1"]),
    ("x^2+2x+1", ["x^2+2x+1", "1"]),
    ("first 3, then 1,234.5 apples", ["first 3, then 1,234.5 apples", "1234.5"]),
    ("nothing", ["nothing"]), ("", [""]),
])
def test_answer_candidates(response: str, candidates: list[str]) -> None:
    assert answer_candidates(response) == candidates


def test_last_boxed_needs_balanced_braces() -> None:
    assert last_boxed(r"\boxed{1") is None and last_boxed("no box") is None
    assert last_boxed(r"\boxed {x^{2}}") == "x^{2}"


@pytest.mark.parametrize(("response", "reference"), [
    ("0.5", "1/2"), (r"\frac{1}{2}", "0.5"), (r"\boxed{\frac12}", "1/2"), (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    (r"2\sqrt{2}", "sqrt(8)"), (r"\boxed{\sqrt{8}}", r"2\sqrt 2"), ("x^2+2x+1", "(x+1)^2"),
    (r"\boxed{(x+1)^{2}}", "x^2 + 2*x + 1"), (r"\boxed{\frac{\sqrt{3}}{2}}", r"\cos(\pi/6)"),
    (r"\boxed{x = 5}", "5"), ("The answer is 42.", "42"), ("so 3, then 7", "7"), (r"\boxed{1,000,000}", "10^6"),
    (r"\boxed{\{2, 1\}}", r"\{1, 2\}"), (r"\boxed{(1, 2)}", "(1, 2)"), (r"e^{i\pi}", "-1"),
    (r"\boxed{50\%}", "0.5"), (r"\boxed{2^{100}}", "1267650600228229401496703205376"), (r"\boxed{\infty}", "oo"),
    (r"\sin^2 x + \cos^2 x", "1"), ("1.4142135624", "sqrt(2)"), (r"\boxed{3}", r"\boxed{3}"),
    (r"\boxed{\frac{x^2-1}{x-1}}", "x+1"), (r"\boxed{\sqrt{x}\sqrt{x}}", "x"),
])
def test_equivalent_answers_score_1(response: str, reference: str) -> None:
    assert math_equiv(response, reference, {}) == right(1.0)


@pytest.mark.parametrize(("response", "reference"), [
    ("3.14159", "pi"), ("0.333", "1/3"), ("12345678901", "12345678902"), (r"\boxed{e^{1000}}", "e^{1000}+1"),
    ("x^2+2x+2", "(x+1)^2"), (r"\boxed{(1, 2)}", "(2, 1)"), (r"\boxed{\{1, 2\}}", "(1, 2)"), ("2", "3"),
    (r"\boxed{\sqrt{x^2}}", "x"), (r"\boxed{\{1, 2\}}", r"\{1, 2, 3\}"), (r"\boxed{x}", "y"), (r"\boxed{-\infty}", "oo"),
    (r"\boxed{10^{10000}}", "10^{10000} + 1"), ("0.5", "0.5000001"),
])
def test_different_answers_score_0(response: str, reference: str) -> None:
    assert math_equiv(response, reference, {}) == right(0.0)


def test_tolerance_from_metadata() -> None:
    assert math_equiv("3.14159", "pi", {"rel_tol": 1e-5}) == right(1.0)
    assert math_equiv("3.14159", "pi", {"rel_tol": 1e-7}) == right(0.0)
    assert math_equiv("0.333", "1/3", {"abs_tol": 1e-3}) == right(1.0)
    assert math_equiv("1/3", "0.33", {"abs_tol": 0.005}) == right(1.0)
    # An explicit tolerance applies to exact answers too.
    assert math_equiv("1000001", "1000000", {"rel_tol": 1e-5}) == right(1.0)
    assert tolerance_from({}) is None
    for bad in ({"rel_tol": -1}, {"abs_tol": "0.1"}, {"rel_tol": float("inf")}, {"rel_tol": True}):
        with pytest.raises(ValueError, match="finite number"):
            math_equiv("1", "1", bad)


def test_response_without_a_parsable_answer_is_a_wrong_answer_not_an_error() -> None:
    for response in ("I do not know", "", r"\boxed{\pm 2}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{1/0}",
                     r"\boxed{" * 3, "x" * 100_000):
        assert math_equiv(response, "2", {}) == UNPARSED, response


def test_unparsable_reference_is_an_error() -> None:
    for reference in ("", "two", r"\pm 2", "x^2 + y^2 = 1", "1/0"):
        with pytest.raises(ValueError, match="reference answer"):
            math_equiv("2", reference, {})


def test_metadata_extract() -> None:
    assert math_equiv("I think 1/2", "1/2", {}) == right(1.0)
    assert math_equiv("I think 1/2", "1/2", {"extract": False}) == UNPARSED
    assert math_equiv("(x+1)^2", "x^2+2x+1", {"extract": False}) == right(1.0)
    with pytest.raises(ValueError, match="extract"):
        math_equiv("1", "1", {"extract": "yes"})


@pytest.mark.parametrize("answer", [r"e^{e^{e^{e^{3}}}}", r"\sin(e^{e^{20}})", r"\sin(e^{e^{e^{x}}})",
                                    r"\sin(2^{1000})", r"\cosh(10^{5})", r"(x+y+z)^{1000}"])
def test_pathological_answers_are_bounded(answer: str) -> None:
    # sympy's evalf never returns on the first three; ours refuses them in milliseconds.
    start = time.perf_counter()
    assert math_equiv(rf"\boxed{{{answer}}}", "1", {}).components["parsed"] == 1.0
    assert time.perf_counter() - start < 2.0


def test_degenerate_repetition_is_linear() -> None:
    # A regex like <answer>(.*?)</answer> is quadratic in unclosed tags; the scan is not.
    start = time.perf_counter()
    assert math_equiv("<answer>" * 130_000, "1", {}) == UNPARSED
    assert math_equiv("<answer>1</answer>" * 50_000, "1", {}) == right(1.0)
    assert time.perf_counter() - start < 3.0


def test_evaluator_bounds() -> None:
    evaluate = Evaluator()
    assert abs(evaluate(sympy.sin(x) ** 2 + sympy.cos(x) ** 2, {x: sympy.Rational(3, 7)}) - 1) < 1e-40
    assert evaluate(sympy.log(x), {x: sympy.Integer(0)}) is None
    assert evaluate(1 / x, {x: sympy.Integer(0)}) is None
    assert evaluate(sympy.Symbol("y"), {}) is None
    with pytest.raises(TooLarge):
        evaluate(sympy.sin(sympy.exp(sympy.exp(20))), {})
    with pytest.raises(TooLarge):
        evaluate(sympy.Integer(10) ** 30000, {})


def test_equivalent_is_symmetric_on_parsed_answers() -> None:
    pairs = [("0.5", r"\frac12"), ("x^2-1", "(x-1)(x+1)"), ("3.14159", r"\pi")]
    for a, b in pairs:
        pa, pb = parse_answer(a), parse_answer(b)
        assert equivalent(pa, pb) == equivalent(pb, pa)


async def test_a_slow_comparison_times_out_and_its_thread_ends() -> None:
    # Two 64-element sets in opposite orders: ~4,000 pairwise trig comparisons at 50 digits,
    # about 1.5 s of real sympy and mpmath work, well past a 0.2 s deadline. The item is
    # TIMEOUT, and since every step is bounded the abandoned thread then finishes.
    items = ", ".join(rf"\sin({k} x)" for k in range(1, 65))
    other = ", ".join(rf"\sin({k} x)" for k in range(64, 0, -1))
    runner = DeadlineRunner(max_concurrency=1, max_stuck=4)
    outcome = await Scorer(timeout_s=0.2, runner=runner).score(math_equiv, rf"\boxed{{\{{{items}\}}}}",
                                                                rf"\{{{other}\}}", {})
    assert outcome.status is ScoreStatus.TIMEOUT and "deadline" in outcome.error
    assert runner.stuck == 1
    for _ in range(600):
        if runner.stuck == 0:
            break
        await asyncio.sleep(0.1)
    assert runner.stuck == 0
