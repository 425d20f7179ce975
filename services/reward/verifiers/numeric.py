"""Bounded numeric evaluation of parsed answers, with mpmath.

sympy's `evalf` raises its working precision until it gets the digits it wants, so
`sin(e^(e^20))` (argument reduction of a 2e8-digit number) or an exponential tower never
returns, and a Python thread cannot be stopped: each such answer would pin a core and a
deadline-runner slot for good. This walker evaluates the node types our parser builds at a
fixed precision, in a private mpmath context (mpmath's global `mp` is shared by all threads),
and refuses any value or trig argument past a magnitude bound with `TooLarge`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mpmath
import sympy

DIGITS = 50
MAX_MAGNITUDE_BITS = 1 << 16
"""No intermediate value may exceed 2**65536 (about 10**19728) in absolute value."""
MAX_PERIODIC_ARG_BITS = 1 << 12
"""Trig arguments up to 2**4096: reducing them needs pi to that many bits, still cheap."""


class TooLarge(ArithmeticError):
    """Evaluating the expression would take unbounded time or memory."""


class Undefined(ArithmeticError):
    """The expression has no finite value at this point (a pole, log 0, an unsupported node)."""


_PERIODIC = {sympy.sin: "sin", sympy.cos: "cos", sympy.tan: "tan", sympy.cot: "cot", sympy.sec: "sec",
             sympy.csc: "csc"}
_GROWING = {sympy.exp: "exp", sympy.sinh: "sinh", sympy.cosh: "cosh"}
_PLAIN = {sympy.asin: "asin", sympy.acos: "acos", sympy.atan: "atan", sympy.tanh: "tanh", sympy.log: "log"}


class Evaluator:
    """Evaluates one comparison's expressions; create one per call (it owns an mpmath context)."""

    def __init__(self, digits: int = DIGITS) -> None:
        self.ctx = mpmath.MPContext()
        self.ctx.dps = digits
        self._limit = self.ctx.mpf(2) ** MAX_MAGNITUDE_BITS

    def __call__(self, expr: sympy.Expr, point: Mapping[sympy.Symbol, sympy.Rational]) -> Any | None:
        """expr's value at `point` (mpf or mpc), None where it is undefined; TooLarge past the bounds."""
        try:
            return self._eval(expr, point)
        except (Undefined, ZeroDivisionError, ValueError, OverflowError):
            return None

    def _eval(self, expr: sympy.Basic, point: Mapping[sympy.Symbol, sympy.Rational]) -> Any:
        value = self._node(expr, point)
        if not self.ctx.isfinite(value):
            raise Undefined(str(expr.func))
        if abs(value) > self._limit:
            raise TooLarge(f"{expr.func.__name__} value is larger than 2**{MAX_MAGNITUDE_BITS}")
        return value

    def _node(self, expr: sympy.Basic, point: Mapping[sympy.Symbol, sympy.Rational]) -> Any:
        ctx = self.ctx
        if expr.is_Rational:
            return ctx.mpf(int(expr.p)) / int(expr.q)
        if expr.is_Symbol:
            if expr not in point:
                raise Undefined(f"no value for {expr}")
            return self._node(point[expr], point)
        constant = {sympy.pi: ctx.pi, sympy.E: ctx.e, sympy.I: ctx.j}.get(expr)
        if constant is not None:
            return +constant
        args = [self._eval(a, point) for a in expr.args]
        return self._apply(expr, args)

    def _apply(self, expr: sympy.Basic, args: list[Any]) -> Any:
        ctx = self.ctx
        if expr.is_Add:
            return ctx.fsum(args)
        if expr.is_Mul:
            return ctx.fprod(args)
        if expr.is_Pow:
            return self._power(*args)
        func = expr.func
        if func in _PERIODIC:
            (arg,) = args
            if arg != 0 and ctx.mag(ctx.re(arg)) > MAX_PERIODIC_ARG_BITS:
                raise TooLarge(f"{_PERIODIC[func]} of a number larger than 2**{MAX_PERIODIC_ARG_BITS}")
            return self._growing(_PERIODIC[func], ctx.im(arg))(arg)
        if func in _GROWING:
            (arg,) = args
            return self._growing(_GROWING[func], ctx.re(arg))(arg)
        if func in _PLAIN:
            if func is sympy.log and args[0] == 0:
                raise Undefined("log(0)")
            return getattr(ctx, _PLAIN[func])(*args)
        if func is sympy.Abs:
            return abs(args[0])
        if func is sympy.factorial:
            return self._growing("factorial", ctx.re(args[0]) * ctx.log(abs(args[0]) + 2))(args[0])
        raise Undefined(f"cannot evaluate {func.__name__}")

    def _growing(self, name: str, exponent: Any) -> Callable[..., Any]:
        """ctx.<name>, after checking that e**|exponent| stays under the magnitude bound."""
        if abs(exponent) > MAX_MAGNITUDE_BITS * 0.69:  # ln 2 ~= 0.69: the bound in nats
            raise TooLarge(f"{name} of a number too large to evaluate")
        fn: Callable[..., Any] = getattr(self.ctx, name)
        return fn

    def _power(self, base: Any, exponent: Any) -> Any:
        ctx = self.ctx
        if base == 0:
            if ctx.re(exponent) <= 0:
                raise Undefined("0 to a non-positive power")
            return ctx.mpf(0)
        # |base**exponent| = e**(re(exponent * log(base))): bound the exponent before computing.
        self._growing("power", ctx.re(exponent * ctx.log(base)))
        return ctx.power(base, exponent)
