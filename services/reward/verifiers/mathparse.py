"""A small, eval-free parser from plain math text to sympy.

`sympify` and `parse_expr` both `eval` the (transformed) string, which is unsafe on model
output and lets `9**9**9**9` or `factorial(10**9)` hang the process. This recursive-descent
parser builds sympy objects itself from a whitelist of tokens, names and functions, and
refuses inputs whose evaluation would blow up (caps on length, depth, literal size and
exponents) before sympy ever sees them.

Grammar (loosest first): `list := expr ("," expr)*`, `expr := term (("+"|"-") term)*`,
`term := unary (("*"|"/"|implicit) unary)*`, `unary := ("+"|"-") unary | power`,
`power := postfix ("^" unary)?`, `postfix := atom ("!"|"%")*`. Implicit multiplication
(`2x`, `2(x+1)`, `x sin x`) is allowed except before a number (`x2`, `2 3` are refused).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import sympy

MAX_CHARS = 1000
MAX_TOKENS = 400
MAX_DEPTH = 48
MAX_LITERAL_DIGITS = 200
MAX_INT_EXPONENT = 10_000
MAX_SYMBOLIC_EXPONENT = 1_000
MAX_RESULT_BITS = 1 << 20
MAX_ARG_BITS = 1024
MAX_FACTORIAL = 1_000
MAX_SEQ_ITEMS = 64

SET_OPEN, SET_CLOSE = "\x01", "\x02"


class ParseError(ValueError):
    """The text is not an answer this parser understands (or would be too costly to evaluate)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Seq:
    """A tuple `(a, b)` (ordered) or a set `{a, b}` (unordered) of answers."""

    kind: str
    """"tuple" or "set"."""
    items: tuple[Value, ...]


Value = sympy.Expr | Seq


@dataclass(frozen=True, kw_only=True, slots=True)
class Parsed:
    value: Value
    approximate: bool
    """A decimal literal appeared (`0.5`): compare numerically, with a tolerance."""


_FUNCTIONS: dict[str, Callable[..., sympy.Expr]] = {
    "sqrt": lambda a: _power(a, sympy.Rational(1, 2)), "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot,
    "sec": sympy.sec, "csc": sympy.csc, "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan, "sinh": sympy.sinh, "cosh": sympy.cosh,
    "tanh": sympy.tanh, "log": sympy.log, "ln": sympy.log, "exp": sympy.exp, "abs": sympy.Abs,
}
# "e" and "i" are Euler's number and the imaginary unit, as in competition answers.
_CONSTANTS: dict[str, sympy.Expr] = {"pi": sympy.pi, "e": sympy.E, "i": sympy.I, "oo": sympy.oo,
                                     "inf": sympy.oo, "infty": sympy.oo, "infinity": sympy.oo}
_GREEK = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
                    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi",
                    "varphi", "chi", "psi", "omega"})
# Longest first, so "exp" wins over "e"·"x"·"p" and "theta" over "t"·"h"·"eta".
_KNOWN = sorted({*_FUNCTIONS, *_CONSTANTS, *_GREEK}, key=len, reverse=True)

_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z]+(?:_[A-Za-z0-9]+)?)"
    r"|(?P<op>\*\*|[-+*/^(),{}\[\]%!|=]|\x01|\x02))", re.ASCII)
_CLOSERS = {"(": ")", "[": "]", SET_OPEN: SET_CLOSE, "{": "}"}


def _split_name(name: str) -> list[str]:
    """`sinx` -> [sin, x]; `xy` -> [x, y]; a subscripted name (`x_1`) stays whole."""
    if "_" in name:
        return [name]
    out, unknown, i = [], 0, 0
    while i < len(name):
        known = next((k for k in _KNOWN if name.startswith(k, i)), None)
        step = len(known) if known else 1
        unknown += known is None
        out.append(name[i:i + step])
        i += step
    # "xy" is x*y and "sinx" is sin(x), but "abc" or "the" is a word, not a product.
    if len(name) > 2 and unknown > 1:
        raise ParseError(f"{name!r} looks like a word; write products with * or spaces")
    return out


def tokenize(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs, kind in num/name/op; ParseError on any other character."""
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise ParseError(f"unexpected character {text[pos:].lstrip()[:1]!r} in {text!r}")
        pos = match.end()
        kind = match.lastgroup
        assert kind is not None
        value = match.group(kind)
        if kind == "name":
            tokens.extend(("name", part) for part in _split_name(value))
        else:
            tokens.append((kind, "^" if value == "**" else value))
        if len(tokens) > MAX_TOKENS:
            raise ParseError(f"answer has more than {MAX_TOKENS} tokens")
    return tokens


def _number(text: str) -> sympy.Rational:
    mantissa, _, exponent = text.lower().partition("e")
    if len(mantissa) > MAX_LITERAL_DIGITS or (exponent and abs(int(exponent)) > MAX_LITERAL_DIGITS):
        raise ParseError(f"number literal {text[:40]!r} is too large")
    return sympy.Rational(text)  # exact: "0.1" is 1/10, never the float 0.1000000000000000055...


def _power(base: sympy.Expr, exponent: sympy.Expr) -> sympy.Expr:
    """base**exponent, refused when evaluating it would build an enormous number."""
    if exponent.is_Rational:
        p, q = abs(int(exponent.p)), int(exponent.q)
        if max(p, q) > MAX_INT_EXPONENT:
            raise ParseError(f"exponent {_brief(exponent)} is too large")
        if base.is_Rational:
            bits = max(int(base.p).bit_length(), int(base.q).bit_length())
            if bits * p // q > MAX_RESULT_BITS:
                raise ParseError("power is too large to evaluate")
            if q > 1 and bits > MAX_ARG_BITS:  # sympy factors the base looking for exact roots
                raise ParseError(f"root of a number over {MAX_ARG_BITS} bits")
        elif base.free_symbols and p > MAX_SYMBOLIC_EXPONENT:
            raise ParseError(f"exponent {_brief(exponent)} is too large for a symbolic base")
    return sympy.Pow(base, exponent)


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.abs_depth = 0
        self.approximate = False

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def accept(self, op: str) -> bool:
        if self.peek() == ("op", op):
            self.pos += 1
            return True
        return False

    def expect(self, op: str) -> None:
        if not self.accept(op):
            found = self.peek()[1] or "end of answer"
            raise ParseError(f"expected {op!r}, found {found!r}")

    def items(self, closer: str | None) -> list[Value]:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"answer is nested more than {MAX_DEPTH} deep")
        out = [] if closer and self.peek() == ("op", closer) else [self.expr()]
        while self.accept(","):
            out.append(self.expr())
        if len(out) > MAX_SEQ_ITEMS:
            raise ParseError(f"more than {MAX_SEQ_ITEMS} items in a tuple or set")
        if closer:
            self.expect(closer)
        self.depth -= 1
        return out

    def guarded(self, parse: Callable[[], Value]) -> Value:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError(f"answer is nested more than {MAX_DEPTH} deep")
        value = parse()
        self.depth -= 1
        return value

    def expr(self) -> Value:
        value = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            sign = self.tokens[self.pos][1]
            self.pos += 1
            rhs = _scalar(self.term())
            value = _scalar(value) + rhs if sign == "+" else _scalar(value) - rhs
        return value

    def term(self) -> Value:
        value = self.unary()
        while True:
            kind, text = self.peek()
            if kind == "op" and text in ("*", "/"):
                self.pos += 1
                rhs = _scalar(self.unary())
                value = _scalar(value) * rhs if text == "*" else _scalar(value) / rhs
            elif kind == "name" or (kind == "op" and (text in ("(", "[") or (text == "|" and not self.abs_depth))):
                value = _scalar(value) * _scalar(self.power())
            elif kind == "num":
                raise ParseError(f"a number ({text}) directly after a factor is ambiguous")
            else:
                return value

    def unary(self) -> Value:
        if self.accept("-"):
            return -_scalar(self.guarded(self.unary))
        if self.accept("+"):
            return _scalar(self.guarded(self.unary))
        return self.power()

    def power(self) -> Value:
        base = self.postfix()
        if self.accept("^"):
            return _power(_scalar(base), _scalar(self.guarded(self.unary)))
        return base

    def postfix(self) -> Value:
        value = self.atom()
        while True:
            if self.accept("%"):
                value = _scalar(value) / 100
            elif self.accept("!"):
                value = _factorial(_scalar(value))
            else:
                return value

    def atom(self) -> Value:
        kind, text = self.peek()
        self.pos += 1
        if kind == "num":
            self.approximate |= "." in text
            return _number(text)
        if kind == "name":
            return self.name(text)
        if text in ("(", "["):
            items = self.items(_CLOSERS[text])
            return items[0] if len(items) == 1 else Seq(kind="tuple", items=tuple(items))
        if text in (SET_OPEN, "{"):
            return Seq(kind="set", items=tuple(self.items(_CLOSERS[text])))
        if text == "|":
            self.abs_depth += 1
            inner = _scalar(self.guarded(self.expr))
            self.expect("|")
            self.abs_depth -= 1
            return sympy.Abs(inner)
        raise ParseError(f"unexpected {text or 'end of answer'!r}")

    def name(self, name: str) -> Value:
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name not in _FUNCTIONS:
            return sympy.Symbol(name)
        exponent = None
        if self.accept("^"):  # sin^2 x
            exponent = _scalar(self.guarded(self.unary))
            if exponent.is_negative:
                raise ParseError(f"{name}^{_brief(exponent)} is ambiguous (inverse or reciprocal?)")
        if self.accept("("):
            args = [_scalar(a) for a in self.items(")")]
        else:
            args = [_scalar(self.guarded(self.power))]
        if any(_bits(a) > MAX_ARG_BITS for a in args):  # log, cosh, ... try to factor huge integers
            raise ParseError(f"{name} of a number over {MAX_ARG_BITS} bits")
        if any(a.has(sympy.oo, -sympy.oo, sympy.zoo) for a in args):  # sin(oo) is an interval, not a number
            raise ParseError(f"{name} of infinity")
        try:
            value = _FUNCTIONS[name](*args)
        except TypeError as e:
            raise ParseError(f"{name} takes different arguments: {e}") from e
        return value if exponent is None else _power(value, exponent)


def _bits(value: sympy.Expr) -> int:
    """Size of the largest integer in `value` (numerators and denominators), in bits."""
    return max((max(int(r.p).bit_length(), int(r.q).bit_length()) for r in value.atoms(sympy.Rational)), default=0)


def _brief(value: sympy.Expr) -> str:
    """str(value), short: printing a 5,000-digit integer raises ValueError in Python >= 3.11."""
    return "(a very large number)" if _bits(value) > 4096 else sympy.sstr(value)[:80]


def _scalar(value: Value) -> sympy.Expr:
    if isinstance(value, Seq):
        raise ParseError("a tuple or set cannot be used inside arithmetic")
    return value


def _factorial(value: sympy.Expr) -> sympy.Expr:
    if value.has(sympy.factorial):  # x!!!... would nest as deep as the answer is long
        raise ParseError("nested factorials are not supported")
    if value.is_number and not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
        raise ParseError(f"factorial needs an integer in [0, {MAX_FACTORIAL}], got {_brief(value)}")
    return sympy.factorial(value)


def parse_plain(text: str) -> Parsed:
    """Parses plain math text (`(x+1)^2`, `1/2`, `{1, 2}`, `x = 3`); ParseError when it cannot."""
    if len(text) > MAX_CHARS:
        raise ParseError(f"answer is longer than {MAX_CHARS} characters")
    tokens = tokenize(text)
    if ("op", "=") in tokens:
        # "x = 3" answers 3; anything else with "=" is an equation we do not compare.
        if tokens.count(("op", "=")) > 1 or len(tokens) < 3 or tokens[0][0] != "name" or tokens[1] != ("op", "="):
            raise ParseError(f"cannot compare an equation: {text!r}")
        tokens = tokens[2:]
    if not tokens:
        raise ParseError("empty answer")
    parser = _Parser(tokens)
    items = parser.items(None)
    if parser.pos != len(tokens):
        raise ParseError(f"unexpected {parser.peek()[1]!r} in {text!r}")
    value = items[0] if len(items) == 1 else Seq(kind="tuple", items=tuple(items))
    if _undefined(value):
        raise ParseError(f"{text!r} is undefined (division by zero?)")
    return Parsed(value=value, approximate=parser.approximate)


def _undefined(value: Value) -> bool:
    if isinstance(value, Seq):
        return any(_undefined(v) for v in value.items)
    return value.has(sympy.nan, sympy.zoo)
