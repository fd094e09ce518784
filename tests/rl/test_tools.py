"""The calculator against Python's own exact arithmetic (Fractions, and ints through eval on generated
integer expressions), its precedence and its limits; BM25 against scores worked out by hand on a
three-document corpus; the stdlib index and its search."""

import math
import re
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.rl.tools.calculator import (
  MAX_DIGITS,
  MAX_LENGTH,
  CalculatorError,
  calculate,
  evaluate,
  format_number,
  numbers,
)
from moejax.rl.tools.result import ToolResult
from moejax.rl.tools.search import DEFAULT_MODULES, MAX_LINE, DocIndex, first_sentence, stdlib_index, words

# ---------------------------------------------------------------------------------------------- calculator

LIMIT = 10**MAX_DIGITS


def _leaf():
  ints = st.integers(0, 10**6).map(lambda n: (str(n), Fraction(n)))
  # A decimal's value from its parts, not from parsing its text as the calculator does.
  decimals = st.tuples(st.integers(0, 999), st.integers(1, 4), st.integers(0, 9999)).map(
    lambda t: (f"{t[0]}.{t[2] % 10**t[1]:0{t[1]}d}", t[0] + Fraction(t[2] % 10**t[1], 10**t[1])))
  return ints | decimals


def _node(children):
  binary = st.tuples(children, st.sampled_from(["+", "-", "*", "/", "//", "%"]), children).map(
    lambda t: (f"({t[0][0]}){t[1]}({t[2][0]})", (t[1], t[0][1], t[2][1])))
  power = st.tuples(children, st.integers(-3, 3)).map(
    lambda t: (f"({t[0][0]})**{t[1]}" if t[1] >= 0 else f"({t[0][0]})**({t[1]})", ("**", t[0][1], t[1])))
  negate = children.map(lambda c: (f"-({c[0]})", ("neg", c[1])))
  return binary | power | negate


# (text, tree) where a tree is a Fraction or (operator, operand...): the value is worked out by _reference.
EXPRESSIONS = st.recursive(_leaf(), _node, max_leaves=8)


def _reference(tree, sizes):
  """tree's value with Python's Fraction operators, appending each intermediate value to sizes."""
  if isinstance(tree, Fraction):
    value = tree
  elif tree[0] == "neg":
    value = -_reference(tree[1], sizes)
  elif tree[0] == "**":
    value = Fraction(_reference(tree[1], sizes)) ** tree[2]
  else:
    op, a, b = tree[0], _reference(tree[1], sizes), _reference(tree[2], sizes)
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None, "//": a // b if b else None,
             "%": a % b if b else None}[op]
    if value is None:
      raise ZeroDivisionError
  value = Fraction(value)  # a Fraction floor division gives an int, whose negative power is a float
  sizes.append(max(abs(value.numerator), value.denominator))
  return value


@settings(max_examples=300, deadline=None)
@given(EXPRESSIONS)
def test_calculator_matches_fraction_arithmetic(expression):
  text, tree = expression
  sizes = []
  try:
    want = _reference(tree, sizes)
  except ZeroDivisionError:
    want = None
  got = calculate(text)
  if len(text) > MAX_LENGTH:
    assert not got.ok and got.output.startswith("too long")
  elif want is None:
    # The calculator may stop at a value too large before it meets the zero divisor.
    assert not got.ok and got.output in ("division by zero", "too large")
  elif max(sizes) >= LIMIT:
    assert not got.ok and got.output == "too large"
  else:
    assert got.ok, (text, got)
    assert got.output == format_number(want)
    assert evaluate(text) == want


def _int_node(children):
  binary = st.tuples(children, st.sampled_from(["+", "-", "*", "//", "%"]), children).map(
    lambda t: f"({t[0]}){t[1]}({t[2]})")
  power = st.tuples(children, st.integers(0, 3)).map(lambda t: f"({t[0]})**{t[1]}")
  return binary | power | children.map(lambda c: f"-{c}") | children.map(lambda c: f"+{c}")


INT_EXPRESSIONS = st.recursive(st.integers(0, 999).map(str), _int_node, max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(INT_EXPRESSIONS)
def test_calculator_matches_python_on_integer_expressions(text):
  try:
    want = eval(text, {"__builtins__": {}})  # the reference: Python's own int arithmetic, on generated text
  except ZeroDivisionError:
    want = None
  got = calculate(text)
  if len(text) > MAX_LENGTH:
    assert not got.ok
  elif want is None:
    assert not got.ok and got.output in ("division by zero", "too large")
  elif abs(want) < LIMIT:
    assert got == calculate(str(want)) and got.output == str(want), (text, got)
  else:
    assert not got.ok and got.output == "too large"


@given(st.fractions(min_value=-10**6, max_value=10**6, max_denominator=10**6))
def test_printed_values_read_back_exactly(value):
  assert evaluate(format_number(value)) == value


@given(st.text(max_size=250))
def test_calculate_never_raises_and_answers_briefly(text):
  got = calculate(text)
  assert isinstance(got.ok, bool) and len(got.output) <= 2 * MAX_DIGITS + 8


@pytest.mark.parametrize("expression,want", [
  ("2+3*4", "14"), ("(2+3)*4", "20"), ("2*3+4", "10"), ("7-2-1", "4"), ("7-(2-1)", "6"), ("8/2/2", "2"),
  ("2**3**2", "512"), ("(2**3)**2", "64"), ("-2**2", "-4"), ("(-2)**2", "4"), ("2*-3", "-6"), ("--3", "3"),
  ("-(1+2)*3", "-9"), ("+5", "5"), ("7//2", "3"), ("-7//2", "-4"), ("7%3", "1"), ("-7%3", "2"),
  ("7.5//2", "3"), ("1/3", "1/3"), ("-7/3", "-7/3"), ("4/6", "2/3"), ("3/2", "1.5"), ("1/8", "0.125"),
  ("-1/8", "-0.125"), ("1/64", "0.015625"), ("1/128", "1/128"), ("0.1+0.2", "0.3"), ("2**-2", "0.25"),
  ("1.50*2", "3"), (".5+1.", "1.5"), ("  4821 * 37 ", "178377"), ("0**0", "1"), ("1**1000000000", "1"),
  ("(-1)**1000001", "-1"), ("10**23", str(10**23)), ("(1/2)**79", f"1/{2**79}"),
])
def test_precedence_and_printing(expression, want):
  assert calculate(expression) == ToolResult(True, want)


@pytest.mark.parametrize("expression", ["1/0", "1//0", "1%0", "0**-1", "1/(2-2)", "5/(0.5-1/2)"])
def test_division_by_zero(expression):
  assert calculate(expression) == ToolResult(False, "division by zero")


@pytest.mark.parametrize("expression", ["9**9**9", "2**100", "10**24", "(1/2)**100", "(-3)**(10**20)",
                                        "2**-(10**20)", "10**12*10**12", "1" * 25, "0." + "0" * 23 + "1"])
def test_huge_values_are_refused_quickly(expression):
  start = time.perf_counter()
  assert calculate(expression) == ToolResult(False, "too large")
  assert time.perf_counter() - start < 0.1


@pytest.mark.parametrize("expression,quoted", [
  ("x", "x"), ("abs(-2)", "abs(-2)"), ("math.pi", "math.pi"), ("'a'", "'a'"),
  ("__import__('os')", "__import__('os')"),
  ("[1, 2]", "[1, 2]"), ("1 if 1 else 2", "1 if 1 else 2"), ("1<2", "1<2"), ("True", "True"), ("1e3", "1e3"),
  ("0x10", "0x10"), ("1_000", "1_000"), ("2j", "2j"), ("4,821*37", "4,821*37"), ("2<<3", "<<"), ("6&3", "&"),
  ("~1", "~1"), ("not 1", "not 1"), ("2^3", "^ (use **)"), ("2**0.5", "non-integer exponent"),
  ("(lambda: 1)()", "(lambda: 1)()"), ("x" * 30, "x" * 21 + "..."),
])
def test_anything_else_is_unsupported(expression, quoted):
  assert calculate(expression) == ToolResult(False, f"unsupported: {quoted}")


@pytest.mark.parametrize("expression,message", [
  ("", "empty expression"), ("   ", "empty expression"), ("2+", "syntax error"), ("(1", "syntax error"),
  ("1 2", "syntax error"), ("1\x00", "syntax error"), ("x = 1", "syntax error"),
])
def test_malformed(expression, message):
  assert calculate(expression) == ToolResult(False, message)


def test_length_limit():
  longest = "1+" * ((MAX_LENGTH - 1) // 2) + "1"
  assert len(longest) == MAX_LENGTH - (MAX_LENGTH % 2 == 0) and calculate(longest).ok
  padded = "1" + "+0" * ((MAX_LENGTH - 1) // 2)
  assert len(padded) <= MAX_LENGTH and calculate(padded).output == "1"
  too_long = "1+" * (MAX_LENGTH // 2) + "1"
  assert len(too_long) > MAX_LENGTH and calculate(too_long).output == f"too long (max {MAX_LENGTH} chars)"
  assert calculate(f"  {padded}  \n").ok  # surrounding white space does not count


def test_restricted_operators_and_literals():
  four = frozenset("+-*/")
  assert evaluate("(8-2)/3*4", four) == 8
  assert evaluate("-(1-4)", four) == 3
  for text, op in [("2**3", "**"), ("7//2", "//"), ("7%2", "%")]:
    with pytest.raises(CalculatorError, match=re.escape(f"unsupported: {op}")):
      evaluate(text, four)
  with pytest.raises(CalculatorError, match="unsupported: unary -"):
    evaluate("-1", frozenset("+"))
  assert numbers("(4+9)*-1 - 6/4.5") == [4, 9, 1, 6, Fraction(9, 2)]
  assert numbers("x+1") == [1]  # literals only: evaluate() is what refuses the name
  with pytest.raises(CalculatorError):
    numbers("'a'+1")


# ---------------------------------------------------------------------------------------------- search

# A document's words, its name's with its text's: one = [m, one, cat, sat] (4), two = [m, two, cat, cat, dog]
# (5), three = [m, three, bird] (3); their mean, avgdl, is 4.
TINY = [("m.one", "cat sat"), ("m.two", "cat cat dog"), ("m.three", "bird")]


def test_bm25_matches_hand_computed_scores():
  index = DocIndex(TINY)
  # norm(d) = k1 * (1 - b + b * |d| / avgdl) = 1.5 * (0.25 + 0.75 * |d| / 4)
  norm_one, norm_two, norm_three = 1.5, 1.78125, 1.21875
  idf_cat = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # in 2 of 3 documents: log(1.6)
  idf_rare = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))  # in 1 of 3: log(8/3)
  idf_m = math.log(1 + (3 - 3 + 0.5) / (3 + 0.5))  # in all: log(8/7)
  assert index.idf("cat") == pytest.approx(math.log(1.6))
  assert index.idf("dog") == pytest.approx(math.log(8 / 3))

  cat = index.scores("cat")
  # f(t, d) * (k1 + 1) / (f(t, d) + norm(d)), with k1 + 1 = 2.5
  assert cat == pytest.approx({"m.one": idf_cat * 2.5 / (1 + norm_one),
                               "m.two": idf_cat * 2 * 2.5 / (2 + norm_two)})
  assert cat["m.one"] == pytest.approx(math.log(1.6))
  assert cat["m.two"] == pytest.approx(math.log(1.6) * 5 / 3.78125)

  dog_bird = index.scores("Dog, BIRD!")
  assert dog_bird == pytest.approx({"m.two": idf_rare * 2.5 / (1 + norm_two),
                                    "m.three": idf_rare * 2.5 / (1 + norm_three)})
  cat_dog = index.scores("cat dog")
  assert cat_dog["m.two"] == pytest.approx(idf_cat * 5 / (2 + norm_two) + idf_rare * 2.5 / (1 + norm_two))
  assert index.scores("cat cat") == index.scores("cat")  # distinct query words
  m = index.scores("m")
  assert m == pytest.approx({n: idf_m * 2.5 / (1 + norm) for n, norm in
                             [("m.one", norm_one), ("m.two", norm_two), ("m.three", norm_three)]})


def test_ranking_order_and_output():
  index = DocIndex(TINY)
  assert [d.name for d, _ in index.ranked("cat")] == ["m.two", "m.one"]
  assert [d.name for d, _ in index.ranked("dog bird")] == ["m.three", "m.two"]  # the shorter document
  assert [d.name for d, _ in index.ranked("m")] == ["m.three", "m.one", "m.two"]
  assert index.search("cat").output == "m.two: cat cat dog"
  assert index.search("cat", k=5).output == "m.two: cat cat dog\nm.one: cat sat"
  assert index.search("zebra") == ToolResult(False, "no match")
  assert index.search("  ?! ") == index.search("") == ToolResult(False, "empty query")
  with pytest.raises(ValueError):
    index.search("cat", k=0)


def test_ties_are_ordered_by_name():
  index = DocIndex([("z.b", "same words"), ("z.c", "same words"), ("z.a", "same words")])
  scores = index.scores("same")
  assert len(set(scores.values())) == 1
  assert [d.name for d, _ in index.ranked("same")] == ["z.a", "z.b", "z.c"]
  assert [d.name for d in index.docs] == ["z.a", "z.b", "z.c"]


def test_lines_are_first_sentences_capped():
  long = "Word " * 100
  index = DocIndex([("m.f", "Return the thing. More about it."), ("m.g", long)])
  assert index.search("thing").output == "m.f: Return the thing."
  line = index.search("word").output
  assert len(line) == MAX_LINE and line.endswith("...")
  assert first_sentence("Use e.g. this. Then") == "Use e.g."  # a known limit: abbreviations end it
  assert first_sentence("no stop") == "no stop" and first_sentence("v1.2 is out.") == "v1.2 is out."
  assert words("make_archive(Base64, x2)") == ["make", "archive", "base64", "x2"]


def test_duplicate_names_are_refused():
  with pytest.raises(ValueError, match="distinct"):
    DocIndex([("m.f", "a"), ("m.f", "b")])


def test_stdlib_index():
  index = DocIndex.from_stdlib()
  assert index is DocIndex.from_stdlib() and index is stdlib_index(DEFAULT_MODULES)  # built once
  names = [d.name for d in index.docs]
  assert len(names) > 100 and len(set(names)) == len(names)
  assert {"statistics.mean", "heapq.nlargest", "shutil.copytree", "urllib.parse.urljoin"} <= set(names)
  assert all(not n.rsplit(".", 1)[1].startswith("_") and d.text and "\n" not in d.text
             for n, d in zip(names, index.docs, strict=True))
  mean = index.search("Return the sample arithmetic mean of data")
  assert mean.ok and mean.output == "statistics.mean: Return the sample arithmetic mean of data."
  assert index.search("copy a directory tree recursively").output.startswith("shutil.copytree: ")
  assert index.search("n largest elements").output.startswith("heapq.nlargest: ")


def test_stdlib_modules_of_choice():
  index = DocIndex.from_stdlib(("textwrap", "json"))
  assert index is not DocIndex.from_stdlib()
  assert {d.name.rsplit(".", 1)[0] for d in index.docs} == {"textwrap", "json"}
  assert "textwrap.dedent" in [d.name for d in index.docs]
  with pytest.raises(ValueError, match="no source file"):
    DocIndex.from_stdlib(("no_such_module_here",))

