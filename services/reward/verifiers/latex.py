"""LaTeX -> plain math text for the common cases in final answers.

sympy's own LaTeX parser needs antlr4, which we do not ship; answers use a small subset
(\\frac, \\sqrt, ^, \\cdot, \\left/\\right, \\pi, braces), so we rewrite that subset into the
plain syntax `mathparse` reads and refuse everything else with a `ParseError` that names the
command. Unknown commands are refused rather than dropped: dropping `\\pm` or `\\le` would
turn a wrong answer into a right one.
"""

from __future__ import annotations

import re

from services.reward.verifiers.mathparse import MAX_DEPTH, ParseError

# Set braces survive as these markers; bare {...} is grouping and becomes (...).
SET_OPEN, SET_CLOSE = "\x01", "\x02"

_DELETE = re.compile(
    r"\\?\$|\\[()\[\]]|\\(?:left|right|big|Big|bigg|Bigg)\.|\\(?:displaystyle|textstyle|limits)(?![A-Za-z])"
    r"|\^\s*\{?\s*\\circ\s*\}?|\\degree(?![A-Za-z])|°")
_SPACE = re.compile(r"\\[,;:! ]|~|\\q?quad(?![A-Za-z])")
_SIZING = re.compile(r"\\(?:left|right|bigg|Bigg|big|Big)(?![A-Za-z])")
_COMMAND = re.compile(r"\\([A-Za-z]+|.)", re.DOTALL)
_THOUSANDS_BRACED = re.compile(r"(?<=\d)\{,\}(?=\d{3})")
_UNICODE = str.maketrans({"−": "-", "×": "*", "·": "*", "⋅": "*", "÷": "/", "π": " pi ", "∞": " oo ",
                          "√": " sqrt ", "\u2009": " ", "\u00a0": " "})

_RENAME = {
    "cdot": "*", "times": "*", "ast": "*", "div": "/", "pi": " pi ", "infty": " oo ", "infinity": " oo ",
    "vert": "|", "lvert": "|", "rvert": "|", "mid": "|", "%": "%", "{": SET_OPEN, "}": SET_CLOSE,
    "lbrace": SET_OPEN, "rbrace": SET_CLOSE, "lbrack": "[", "rbrack": "]", "langle": "(", "rangle": ")",
    "cdotp": "*", "e": " e ",
}
_NAMED = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "arcsin", "arccos", "arctan", "sinh", "cosh", "tanh",
    "log", "ln", "exp", "alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta",
    "vartheta", "iota", "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi", "chi",
    "psi", "omega",
})
_DROP_WITH_ARG = frozenset({"text", "textrm", "textnormal", "mbox", "hbox", "textup"})
_UNWRAP = frozenset({"mathrm", "mathbf", "mathit", "mathsf", "textbf", "textit", "boxed", "fbox",
                     "operatorname", "mathnormal", "bm", "boldsymbol"})
_FRACS = frozenset({"frac", "dfrac", "tfrac", "cfrac"})


class _Reader:
    """Recursive rewrite of one LaTeX string; `pos` walks it left to right."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def error(self, why: str) -> ParseError:
        return ParseError(f"{why} at character {self.pos} of {self.text!r}")

    def enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:  # a ParseError here, not a RecursionError later
            raise self.error(f"nested more than {MAX_DEPTH} deep")

    def until(self, stop: str | None) -> str:
        self.enter()
        out: list[str] = []
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == stop:
                self.pos += 1
                self.depth -= 1
                return "".join(out)
            if c == "}":
                raise self.error("unbalanced '}'")
            out.append(self.item())
        if stop is not None:
            raise self.error(f"missing {stop!r}")
        return "".join(out)

    def item(self) -> str:
        c = self.text[self.pos]
        if c == "{":
            self.pos += 1
            inner = self.until("}")
            # A braced list "{1, 2}" is a set; any other group is just grouping.
            return SET_OPEN + inner + SET_CLOSE if _top_level_comma(inner) else "(" + inner + ")"
        if c == "\\":
            return self.command()
        if c == "_":
            self.pos += 1
            sub = self.raw_arg()
            if not re.fullmatch(r"[A-Za-z0-9]+", sub):
                raise self.error(f"unsupported subscript {sub!r}")
            return "_" + sub
        self.pos += 1
        return c

    def command(self) -> str:
        self.enter()
        rewritten = self._command()
        self.depth -= 1
        return rewritten

    def _command(self) -> str:
        match = _COMMAND.match(self.text, self.pos)
        if match is None:
            raise self.error("dangling backslash")
        self.pos = match.end()
        name = match.group(1)
        if name in _RENAME:
            return _RENAME[name]
        if name in _NAMED:
            return f" {name} "
        if name in _FRACS:
            num, den = self.arg(), self.arg()
            return f"(({num})/({den}))"
        if name == "sqrt":
            return self.sqrt()
        if name in _DROP_WITH_ARG:
            self.raw_arg()
            return " "
        if name in _UNWRAP:
            return "(" + self.arg() + ")"
        raise self.error(f"unsupported LaTeX command \\{name}")

    def sqrt(self) -> str:
        self.skip_space()
        index = None
        if self.text.startswith("[", self.pos):
            self.pos += 1
            index = self.until("]")
        radicand = self.arg()
        return f"sqrt({radicand})" if index is None else f"(({radicand})^(1/({index})))"

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def arg(self) -> str:
        """One macro argument, rewritten: a {group}, a \\command, or a single character (\\frac12)."""
        self.skip_space()
        if self.pos >= len(self.text):
            raise self.error("missing argument")
        c = self.text[self.pos]
        if c == "{":
            self.pos += 1
            return self.until("}")
        if c == "\\":
            return self.command()
        if c in "}^_":
            raise self.error(f"missing argument before {c!r}")
        self.pos += 1
        return c

    def raw_arg(self) -> str:
        """One argument, unrewritten (for \\text{...} and subscripts)."""
        self.skip_space()
        if self.text.startswith("{", self.pos):
            depth, start = 0, self.pos
            for i in range(self.pos, len(self.text)):
                depth += {"{": 1, "}": -1}.get(self.text[i], 0)
                if depth == 0:
                    self.pos = i + 1
                    return self.text[start + 1:i]
            raise self.error("missing '}'")
        if self.pos >= len(self.text):
            raise self.error("missing argument")
        self.pos += 1
        return self.text[self.pos - 1]


def _top_level_comma(text: str) -> bool:
    depth = 0
    for c in text:
        if c in "([" + SET_OPEN:
            depth += 1
        elif c in ")]" + SET_CLOSE:
            depth -= 1
        elif c == "," and depth == 0:
            return True
    return False


def latex_to_plain(text: str) -> str:
    """Plain math text (`x^(2)+((1)/(2))`) for a LaTeX or plain answer; ParseError if unsupported."""
    text = _THOUSANDS_BRACED.sub("", text.translate(_UNICODE))
    text = _DELETE.sub("", text)
    text = _SIZING.sub("", _SPACE.sub(" ", text))
    text = text.replace("\\%", "%")
    return _Reader(text).until(None)
