"""The `calculator` tool: arithmetic over an `ast` whitelist, never `eval`.

Python integers are unbounded, so `9**9**9` or a chain of multiplications could pin a CPU
for minutes; every integer result is checked against MAX_INT_BITS, and a power is refused
before it is computed if its result would exceed that.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # about 1233 decimal digits

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
FUNCTIONS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "log": math.log, "log10": math.log10, "exp": math.exp,
    "abs": abs, "floor": math.floor, "ceil": math.ceil,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of `expression`, or CalculatorError with a message an agent can act on."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not a valid expression: {e.msg}") from None
    try:
        value = _eval(tree.body)
    except CalculatorError:
        raise
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as e:
        raise CalculatorError(f"cannot evaluate: {e}") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _eval(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        # bool is an int subclass; True + 1 is not arithmetic an agent means.
        if type(node.value) not in (int, float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise CalculatorError(
                f"unknown function in {ast.unparse(node.func)!r} "
                f"(allowed: {', '.join(sorted(FUNCTIONS))})"
            )
        if node.keywords:
            raise CalculatorError("functions take positional arguments only")
        return _checked(FUNCTIONS[node.func.id](*(_eval(arg) for arg in node.args)))
    raise CalculatorError(
        f"{ast.unparse(node)!r} is not allowed: use numbers, + - * / // % **, parentheses, "
        f"{', '.join(sorted(CONSTANTS))} and {', '.join(sorted(FUNCTIONS))}()"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse an integer power whose result would exceed MAX_INT_BITS, before computing it
    (float powers overflow cheaply into OverflowError on their own)."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > MAX_INT_BITS:
            raise CalculatorError(f"result too large (limit {MAX_INT_BITS} bits)")


def _checked(value: int | float) -> int | float:
    if type(value) not in (int, float):  # (-8) ** 0.5 is complex
        raise CalculatorError(f"result is not a real number: {value}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (limit {MAX_INT_BITS} bits)")
    return value
