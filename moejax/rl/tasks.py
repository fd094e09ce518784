"""Verifiable tasks for agentic RL: generated locally from a numpy Generator (the same draws give the same
task), checked by `score`, and solved by `solve` with the tool calls that SFT transcripts show.

  arithmetic  "Compute 4821*3907."                          answer "18835647"   (calculator)
  countdown   "Reach 37 with 4, 9, 1, 6."                   answer "4*9+1"      (checked with the calculator)
  docstring   "Which function: 'Return the high median of data'?"   answer "statistics.median_high" (search)

The final answer of a transcript is what follows its last "Answer:", up to the end of that line, stripped.
It is right when:
  arithmetic: it is the integer, once commas and spaces are taken out (a trailing "." is allowed);
  countdown: it is an expression of + - * / and parentheses alone (unary minus too), using each given number
    at most once (not necessarily all), whose exact value is the target (fractions along the way are
    fine); nothing else on the line, not even "= 37";
  docstring: it is the full name "module.function" (a trailing "." and surrounding backticks allowed). The
    bare function name is not accepted: names repeat across modules (copy.copy, shutil.copy), and the
    search tool always answers with the full one.
"""

import dataclasses
import functools
import re
from collections import Counter

import numpy as np

from moejax.rl.tools.calculator import CalculatorError, evaluate, numbers
from moejax.rl.tools.search import DocIndex, first_sentence

COUNTDOWN_OPERATORS = frozenset({"+", "-", "*", "/"})
PHRASE_WORDS = 8  # most words of a docstring question's phrase

_ARITHMETIC = re.compile(r"Compute (.+)\.")
_COUNTDOWN = re.compile(r"Reach (\d+) with (\d+(?:, \d+)*)\.")
_DOCSTRING = re.compile(r"Which function: '(.+)'\?")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
_ATOM = 3
_DANGLING = frozenset("a an and are as at be by for from if in into is its of on or than that the their to"
                      " which with".split())


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: its kind (a key of TASKS), the user's text, and the reference answer."""

  kind: str
  prompt: str
  answer: str


@dataclasses.dataclass(frozen=True)
class Solution:
  """The reference tool use: (tool name, body) calls in order, then the final answer."""

  tool_calls: tuple[tuple[str, str], ...]
  answer: str


def arithmetic(rng: np.random.Generator, digits: tuple[int, int] = (3, 4)) -> Task:
  """A product of two numbers (three times in four), else a sum and difference of three, each number with
  between digits[0] and digits[1] digits: beyond a tiny model's head, not beyond the calculator."""
  lo, hi = digits
  if not 1 <= lo <= hi:
    raise ValueError(f"digits must be (min, max) with 1 <= min <= max, got {digits}")

  def number():
    d = int(rng.integers(lo, hi + 1))
    return int(rng.integers(10**(d - 1), 10**d))

  if rng.random() < 0.75:
    expression = f"{number()}*{number()}"
  else:
    a, b, c = number(), number(), number()
    expression = f"{a}{'+-'[int(rng.integers(2))]}{b}{'+-'[int(rng.integers(2))]}{c}"
  return Task("arithmetic", f"Compute {expression}.", str(evaluate(expression).numerator))


def countdown(rng: np.random.Generator, count: int = 4, max_number: int = 25, max_target: int = 999) -> Task:
  """count numbers in [1, max_number] and a target that an expression over all of them reaches: the numbers
  are combined two at a time, at random, by + * and, where the result stays a positive integer, - and /
  (by more than 1). Draws again until the target is at most max_target and is not one of the numbers."""
  if count < 2 or max_number < 2:
    raise ValueError(f"need count >= 2 and max_number >= 2, got count={count}, max_number={max_number}")
  while True:
    drawn = [int(n) for n in rng.integers(1, max_number + 1, size=count)]
    pool = [(n, str(n), _ATOM) for n in drawn]  # (value, text, precedence of its top operator)
    while len(pool) > 1:
      i, j = (int(k) for k in rng.choice(len(pool), size=2, replace=False))
      a, b = pool[i][0], pool[j][0]
      ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
      node = _combine(pool[i], ops[int(rng.integers(len(ops)))], pool[j])
      pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [node]
    target, text, _ = pool[0]
    if target <= max_target and target not in drawn:
      return Task("countdown", f"Reach {target} with {', '.join(map(str, drawn))}.", text)


def docstring_question(rng: np.random.Generator, index: DocIndex) -> Task:
  """Which function of the index a phrase from its docstring describes: the first PHRASE_WORDS words of its
  first sentence. Only functions whose phrase, searched, ranks them first, strictly, are asked about."""
  questions = answerable(index)
  if not questions:
    raise ValueError("no document in the index has a phrase that its search ranks first")
  name, phrase = questions[int(rng.integers(len(questions)))]
  return Task("docstring", f"Which function: '{phrase}'?", name)


TASKS = {"arithmetic": arithmetic, "countdown": countdown, "docstring": docstring_question}


def make_task(kind: str, rng: np.random.Generator, index: DocIndex | None = None) -> Task:
  """A task of the kind, with its generator's default settings; docstring questions come from index, by
  default the stdlib's (DocIndex.from_stdlib())."""
  if kind not in TASKS:
    raise ValueError(f"unknown task kind {kind!r}; expected one of {sorted(TASKS)}")
  if kind == "docstring":
    return docstring_question(rng, index if index is not None else DocIndex.from_stdlib())
  return TASKS[kind](rng)


def final_answer(text: str) -> str | None:
  """What follows the last "Answer:" in text, up to the end of its line, stripped; None if there is none."""
  at = text.rfind("Answer:")
  if at < 0:
    return None
  return re.split(r"[\r\n]", text[at + len("Answer:"):], maxsplit=1)[0].strip()


def score(task: Task, final_text: str) -> float:
  """1.0 if the final answer in final_text is right for the task (see the module's docstring), else 0.0."""
  if task.kind not in _RIGHT:
    raise ValueError(f"unknown task kind {task.kind!r}; expected one of {sorted(_RIGHT)}")
  answer = final_answer(final_text)
  return 1.0 if answer and _RIGHT[task.kind](task, answer) else 0.0


def solve(task: Task) -> Solution:
  """The reference solution: arithmetic computes the prompt's expression with the calculator, countdown
  checks its answer with the calculator, docstring searches for the phrase."""
  if task.kind == "arithmetic":
    return Solution((("calculator", _ARITHMETIC.fullmatch(task.prompt)[1]),), task.answer)
  if task.kind == "countdown":
    return Solution((("calculator", task.answer),), task.answer)
  if task.kind == "docstring":
    return Solution((("search", _DOCSTRING.fullmatch(task.prompt)[1]),), task.answer)
  raise ValueError(f"unknown task kind {task.kind!r}; expected one of {sorted(TASKS)}")


def phrase(text: str) -> str | None:
  """The question phrase for a docstring paragraph: its first sentence's first PHRASE_WORDS words, less a
  final stop or comma and any small word left dangling where it was cut ("... in base85 format and"); None
  when under three words, or when it has a quote or an angle bracket, which would break the prompt's quotes
  or the transcript's tags."""
  found = first_sentence(text).split()[:PHRASE_WORDS]
  while found and (found[-1].lower() in _DANGLING or not found[-1].rstrip(".,;:")):
    found.pop()
  found = " ".join(found).rstrip(".,;:")
  if len(found.split()) < 3 or any(c in found for c in "'\"`<>"):
    return None
  return found


@functools.lru_cache(maxsize=8)
def answerable(index: DocIndex) -> tuple[tuple[str, str], ...]:
  """(name, phrase) for each document whose phrase, as a search query, ranks it first with a score
  strictly above the next; cached per index (a search for each document)."""
  found = []
  for doc in index.docs:
    query = phrase(doc.text)
    if query is None:
      continue
    hits = index.ranked(query)
    if hits and hits[0][0].name == doc.name and (len(hits) == 1 or hits[1][1] < hits[0][1] - 1e-9):
      found.append((doc.name, query))
  return tuple(found)


def _combine(left, op, right):
  """(value, text, precedence) of left op right, parenthesised only where the text needs it."""
  a, left_text, left_prec = left
  b, right_text, right_prec = right
  p = _PRECEDENCE[op]
  if left_prec < p:
    left_text = f"({left_text})"
  # a-(b+c) and a/(b*c) need theirs; a+(b-c) and a*(b/c) do not, evaluated exactly.
  if right_prec < p or (right_prec == p and op in "-/"):
    right_text = f"({right_text})"
  value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
  return value, f"{left_text}{op}{right_text}", p


def _arithmetic_right(task: Task, answer: str) -> bool:
  digits = re.sub(r"[,\s]", "", answer).removesuffix(".")
  # Bounded before int(), which refuses strings of thousands of digits.
  if len(digits) > 64 or not re.fullmatch(r"[+-]?[0-9]+", digits):
    return False
  return int(digits) == int(task.answer)


def _countdown_right(task: Task, answer: str) -> bool:
  match = _COUNTDOWN.fullmatch(task.prompt)
  target, given = int(match[1]), Counter(int(n) for n in match[2].split(", "))
  try:
    value = evaluate(answer, COUNTDOWN_OPERATORS)
    used = numbers(answer)
  except CalculatorError:
    return False
  # Counter subtraction keeps only what is left over: numbers not given, or used more often than given.
  return value == target and not (Counter(used) - given)


def _docstring_right(task: Task, answer: str) -> bool:
  return answer.removesuffix(".").strip("`") == task.answer


_RIGHT = {"arithmetic": _arithmetic_right, "countdown": _countdown_right, "docstring": _docstring_right}
