"""Arithmetic on untrusted text without `eval`: parse to an AST, walk only number nodes and
arithmetic operators, and bound every size so `9**9**9` or a 1 MB expression costs nothing."""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_INT_BITS = 2048
"""About 617 decimal digits: far past any task, far below what makes arithmetic slow."""
MAX_EXPONENT = 1024
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
"""A comma inside "1,234" (how people write 1234); other commas stay and are refused."""


class EvalError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why."""


Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS = {ast.BitXor: "^ (write ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
            ast.RShift: ">>", ast.MatMult: "@"}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses over numbers)."""
    text = expression.strip()
    if not text:
        raise EvalError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise EvalError(f"the expression has {len(text)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(_THOUSANDS.sub("", text), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise EvalError(f"not a valid expression: {getattr(e, 'msg', e)}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > MAX_NODES:
        raise EvalError(f"the expression has {nodes} parts; the limit is {MAX_NODES}")
    return _eval(tree.body)


def _eval(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        _precheck(type(node.op), left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise EvalError("division by zero") from None
        except OverflowError:
            raise EvalError("the result is too large") from None
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
        raise EvalError(f"operator {_SYMBOLS[type(node.op)]} is not supported; use + - * / // % **")
    raise EvalError(f"{_describe(node)} is not allowed; only numbers, + - * / // % ** and parentheses")


def _precheck(op: type[ast.operator], left: Number, right: Number) -> None:
    """Refuses before computing what would be too large to compute cheaply."""
    if op is ast.Pow:
        if abs(right) > MAX_EXPONENT:
            raise EvalError(f"exponent {right} is too large; the limit is {MAX_EXPONENT}")
        if isinstance(left, int) and isinstance(right, int) and right > 0 \
                and left.bit_length() * right > MAX_INT_BITS + right:
            raise EvalError("the result is too large")
        if left == 0 and right < 0:
            raise EvalError("division by zero")
    if op is ast.Mult and isinstance(left, int) and isinstance(right, int) \
            and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise EvalError("the result is too large")


def _bounded(value: Number) -> Number:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise EvalError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise EvalError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise EvalError("the result is too large")
    return value


def _describe(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Constant):
        return f"constant {node.value!r}"
    return type(node).__name__


def format_number(value: Number) -> str:
    """Integers as digits; floats in Python's shortest form, whole ones without ".0"."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)
