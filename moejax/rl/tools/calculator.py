"""The calculator tool: exact arithmetic over a small expression language, evaluated by walking the syntax
tree that `ast` parses (nothing is ever eval'd).

The language: integer and decimal literals (`12`, `0.25`), binary + - * / // % **, unary - and +, and
parentheses, with Python's precedence (so `-2**2` is -4 and `2**3**2` is 512). Values are Fractions: `/` is
exact division, `//` and `%` floor as Python's do, and an exponent must be an integer.

A result is printed as an integer when whole, as a decimal when it ends within DECIMAL_PLACES places
(`0.125`), else as a reduced fraction (`-7/3`): exact either way, short, and itself a valid expression, so
the model can feed an answer back in.

Limits keep a call cheap and its answer short: the expression is at most MAX_LENGTH characters, and every
value along the way, literals included, has numerator and denominator below 10**MAX_DIGITS. A power is
refused from the sizes of its operands before it is computed, so `9**9**9` costs nothing.
"""

import ast
import re
from fractions import Fraction

from moejax.rl.tools.result import ToolResult

MAX_LENGTH = 200
MAX_DIGITS = 24
DECIMAL_PLACES = 6
OPERATORS = frozenset({"+", "-", "*", "/", "//", "%", "**"})

_LIMIT = 10**MAX_DIGITS
_LIMIT_BITS = _LIMIT.bit_length()
# ASCII digits only: no exponents, underscores, hex or imaginary literals, which the language has no use for.
_LITERAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitXor: "^",
           ast.BitAnd: "&", ast.MatMult: "@"}
_SNIPPET = 24  # characters of the offending text an "unsupported" message quotes


class CalculatorError(ValueError):
  """An expression the calculator refuses; the message is the tool's short output."""


def evaluate(expression: str, operators: frozenset[str] = OPERATORS) -> Fraction:
  """The exact value of expression; raises CalculatorError. operators: the binary operators allowed (a
  subset of OPERATORS); unary minus and plus go with binary - and +."""
  tree, text = _parse(expression)
  return _eval(tree.body, text, operators)


def numbers(expression: str) -> list[Fraction]:
  """The values of expression's number literals, in the order they are written (a negated literal gives its
  absolute value); raises CalculatorError if it does not parse or a constant is not a number."""
  tree, text = _parse(expression)
  found = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Constant)),
                 key=lambda n: (n.lineno, n.col_offset))
  return [_literal(n, text) for n in found]


def format_number(value: Fraction) -> str:
  """value as the calculator prints it: `12`, `-0.125`, `7/3`."""
  if value.denominator == 1:
    return str(value.numerator)
  for places in range(1, DECIMAL_PLACES + 1):
    if 10**places % value.denominator == 0:
      whole, part = divmod(abs(value.numerator) * (10**places // value.denominator), 10**places)
      return f"{'-' if value < 0 else ''}{whole}.{part:0{places}d}"
  return f"{value.numerator}/{value.denominator}"


def calculate(expression: str) -> ToolResult:
  """The calculator tool: the value of expression, or ok=False with a short reason (`division by zero`,
  `too large`, `unsupported: sqrt(2)`, ...). Never raises."""
  try:
    return ToolResult(True, format_number(evaluate(expression)))
  except CalculatorError as e:
    return ToolResult(False, str(e))


def _parse(expression: str) -> tuple[ast.Expression, str]:
  text = expression.strip()
  if not text:
    raise CalculatorError("empty expression")
  if len(text) > MAX_LENGTH:
    raise CalculatorError(f"too long (max {MAX_LENGTH} chars)")
  try:
    return ast.parse(text, mode="eval"), text
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalculatorError("syntax error") from None


def _eval(node: ast.AST, text: str, operators: frozenset[str]) -> Fraction:
  if isinstance(node, ast.Constant):
    return _checked(_literal(node, text))
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    symbol = "-" if isinstance(node.op, ast.USub) else "+"
    if symbol not in operators:
      raise CalculatorError(f"unsupported: unary {symbol}")
    value = _eval(node.operand, text, operators)
    return -value if symbol == "-" else value
  if isinstance(node, ast.BinOp):
    symbol = _BINARY.get(type(node.op), "?")
    if symbol not in operators:
      # `^` is how people write powers; say what the calculator wants instead.
      raise CalculatorError(f"unsupported: {symbol}" + (" (use **)" if symbol == "^" else ""))
    a = _eval(node.left, text, operators)
    b = _eval(node.right, text, operators)
    return _checked(_apply(symbol, a, b))
  raise CalculatorError(f"unsupported: {_snippet(node, text)}")


def _literal(node: ast.Constant, text: str) -> Fraction:
  source = ast.get_source_segment(text, node) or ""
  # type(), not isinstance: True and False are ints to isinstance.
  if type(node.value) not in (int, float) or not _LITERAL.fullmatch(source):
    raise CalculatorError(f"unsupported: {_snippet(node, text)}")
  # From the written digits, not node.value: a decimal is exact, never the float Python would make of it.
  return Fraction(source)


def _apply(symbol: str, a: Fraction, b: Fraction) -> Fraction:
  if symbol == "+":
    return a + b
  if symbol == "-":
    return a - b
  if symbol == "*":
    return a * b
  if symbol in ("/", "//", "%"):
    if b == 0:
      raise CalculatorError("division by zero")
    return a / b if symbol == "/" else Fraction(a // b) if symbol == "//" else a % b
  if b.denominator != 1:
    raise CalculatorError("unsupported: non-integer exponent")
  e = b.numerator
  if a == 0 and e < 0:
    raise CalculatorError("division by zero")
  # |a| has at least bits-1 bits on one side of the fraction bar, so |a|**e at least (bits-1)*|e|: refuse
  # before computing. 0, 1 and -1 stay small under any exponent, and Python raises them to one quickly.
  bits = max(abs(a.numerator).bit_length(), a.denominator.bit_length())
  if abs(a) != 1 and a != 0 and (bits - 1) * abs(e) > _LIMIT_BITS:
    raise CalculatorError("too large")
  return a**e


def _checked(value: Fraction) -> Fraction:
  if abs(value.numerator) >= _LIMIT or value.denominator >= _LIMIT:
    raise CalculatorError("too large")
  return value


def _snippet(node: ast.AST, text: str) -> str:
  source = " ".join((ast.get_source_segment(text, node) or type(node).__name__).split())
  return source if len(source) <= _SNIPPET else source[:_SNIPPET - 3] + "..."
