"""Tasks: the same seed gives the same tasks; every generated answer is right by `score`, wrong and missing
answers are not, and the last "Answer:" is the one that counts; countdown answers use each number at most
once; every docstring question's phrase finds its function first; the reference solutions' tool calls give
what the answers need."""

import re
from collections import Counter

import numpy as np
import pytest

from moejax.rl import tasks
from moejax.rl.tasks import Solution, Task, make_task, score, solve
from moejax.rl.tools.calculator import calculate, evaluate, numbers
from moejax.rl.tools.search import DocIndex

INDEX = DocIndex.from_stdlib()


def _many(kind, seed, n=50):
  rng = np.random.default_rng(seed)
  return [make_task(kind, rng, INDEX) for _ in range(n)]


@pytest.mark.parametrize("kind", sorted(tasks.TASKS))
def test_a_seed_gives_the_same_tasks(kind):
  assert _many(kind, 7) == _many(kind, 7)
  assert _many(kind, 7) != _many(kind, 8)
  assert all(t.kind == kind for t in _many(kind, 7))


@pytest.mark.parametrize("kind", sorted(tasks.TASKS))
def test_reference_answers_score_one_and_others_zero(kind):
  for task in _many(kind, 1):
    assert score(task, f"Answer: {task.answer}") == 1.0
    assert score(task, f"Let me see.\nAnswer:   {task.answer}  \nThat is all.") == 1.0  # up to end of line
    assert score(task, f"I think it is {task.answer}.") == 0.0  # no "Answer:"
    assert score(task, "Answer:") == score(task, "Answer: \n" + task.answer) == 0.0
    assert score(task, "Answer: 12345678901") == 0.0
    # The last "Answer:" wins, either way round.
    assert score(task, f"Answer: 12345678901\nAnswer: {task.answer}") == 1.0
    assert score(task, f"Answer: {task.answer}\nAnswer: 12345678901") == 0.0
    assert score(task, f"Answer: {task.answer}\r\nnothing") == 1.0


def test_arithmetic():
  for task in _many("arithmetic", 2, 200):
    expression = re.fullmatch(r"Compute (.+)\.", task.prompt)[1]
    assert re.fullmatch(r"[0-9]{3,4}(\*[0-9]{3,4}|[+-][0-9]{3,4}[+-][0-9]{3,4})", expression)
    assert task.answer == str(eval(expression, {"__builtins__": {}}))  # Python's own int arithmetic
  products = sum("*" in t.prompt for t in _many("arithmetic", 2, 200))
  assert 120 < products < 180  # three in four
  two_digit = tasks.arithmetic(np.random.default_rng(0), digits=(2, 2))
  assert re.fullmatch(r"Compute [0-9]{2}[-+*][0-9]{2}([-+][0-9]{2})?\.", two_digit.prompt)
  with pytest.raises(ValueError):
    tasks.arithmetic(np.random.default_rng(0), digits=(4, 3))


def test_arithmetic_answers_allow_separators():
  task = Task("arithmetic", "Compute 1234*1000.", "1234000")
  for right in ["1234000", "1,234,000", "1 234 000", "1234000.", "+1234000"]:
    assert score(task, f"Answer: {right}") == 1.0, right
  for wrong in ["1234001", "1234000.5", "1.234.000", "1234*1000", "about 1234000", "-1234000", "9" * 5000]:
    assert score(task, f"Answer: {wrong}") == 0.0, wrong
  negative = Task("arithmetic", "Compute 100-2000+3.", "-1897")
  assert score(negative, "Answer: -1,897") == 1.0


def test_countdown():
  for task in _many("countdown", 3, 200):
    match = re.fullmatch(r"Reach (\d+) with (\d+), (\d+), (\d+), (\d+)\.", task.prompt)
    target, given = int(match[1]), [int(n) for n in match.groups()[1:]]
    assert 0 < target <= 999 and target not in given and all(1 <= n <= 25 for n in given)
    assert evaluate(task.answer) == target
    assert Counter(numbers(task.answer)) == Counter(given)  # the generator's answer uses them all
    assert set(task.answer) <= set("0123456789+-*/()")
  for count in (2, 3, 5):
    task = tasks.countdown(np.random.default_rng(count), count=count, max_number=10)
    assert len(re.fullmatch(r"Reach \d+ with (.+)\.", task.prompt)[1].split(", ")) == count


def test_countdown_answers_use_each_number_at_most_once():
  task = Task("countdown", "Reach 8 with 4, 2, 1, 4.", "4*2")
  right = ["4*2", "4+4", "4*2*1", "(4+4)*1", "4/(1/2)", "(4+4)/(2-1)", "-(2-4)*4", " 4+4*1 "]
  for answer in right:
    assert score(task, f"Answer: {answer}") == 1.0, answer
  wrong = [
    "2*2*2",  # 2 reused
    "4+4+1-1",  # 1 reused
    "4+2+1+1",  # 1 reused
    "8",  # 8 is not given
    "16/2",  # nor is 16
    "2**3",  # ** is not allowed
    "(4*4)//2",  # nor //
    "4*2 = 8",  # nothing but the expression
    "4*2+1",  # 9
    "x",
    "4.0*2.5-2",  # 2.5 is not given
    "",
  ]
  for answer in wrong:
    assert score(task, f"Answer: {answer}") == 0.0, answer
  assert score(Task("countdown", "Reach 6 with 3, 4, 8.", "8/4*3"), "Answer: 8/(4/3)") == 1.0  # exact


def test_docstring_questions_find_their_function_first():
  questions = tasks.answerable(INDEX)
  assert len(questions) > 50
  for task in _many("docstring", 4, 200):
    phrase = re.fullmatch(r"Which function: '(.+)'\?", task.prompt)[1]
    assert (task.answer, phrase) in questions
    hits = INDEX.ranked(phrase)
    assert hits[0][0].name == task.answer and (len(hits) == 1 or hits[1][1] < hits[0][1])
    assert INDEX.search(phrase).output.startswith(f"{task.answer}: ")
  for name, phrase in questions:
    assert INDEX.ranked(phrase)[0][0].name == name
    assert 3 <= len(phrase.split()) <= tasks.PHRASE_WORDS and not set(phrase) & set("'\"`<>")


def test_docstring_questions_skip_what_search_cannot_tell_apart():
  index = DocIndex([("a.f", "Return the sum of two numbers."), ("b.f", "Return the sum of two numbers."),
                    ("c.g", "Split a string into shell words."), ("d.h", "Hi."),
                    ("e.k", "Quote 'this' text please now.")])
  assert tasks.answerable(index) == (("c.g", "Split a string into shell words"),)
  task = tasks.docstring_question(np.random.default_rng(0), index)
  assert task == Task("docstring", "Which function: 'Split a string into shell words'?", "c.g")
  with pytest.raises(ValueError, match="no document"):
    tasks.docstring_question(np.random.default_rng(0), DocIndex([("a.f", "Hi.")]))


def test_docstring_answers_need_the_full_name():
  task = Task("docstring", "Which function: 'Return the high median of data'?", "statistics.median_high")
  for right in ["statistics.median_high", "statistics.median_high.", "`statistics.median_high`"]:
    assert score(task, f"Answer: {right}") == 1.0, right
  for wrong in ["median_high", "statistics.median", "Statistics.median_high", "statistics.median_high()"]:
    assert score(task, f"Answer: {wrong}") == 0.0, wrong


def test_phrases():
  assert tasks.phrase("Encode bytes-like object b in base85 format and return a bytes object.") == (
    "Encode bytes-like object b in base85 format")
  assert tasks.phrase("Copy data and metadata. Return the file's destination.") == "Copy data and metadata"
  assert tasks.phrase("Hi there.") is None and tasks.phrase("Use <b> tags for it.") is None


@pytest.mark.parametrize("kind", sorted(tasks.TASKS))
def test_solutions_tool_calls_give_the_answer(kind):
  for task in _many(kind, 5, 30):
    solution = solve(task)
    assert isinstance(solution, Solution) and solution.answer == task.answer
    assert len(solution.tool_calls) == 1
    tool, body = solution.tool_calls[0]
    assert body in task.prompt or kind == "countdown"
    if kind == "docstring":
      result = INDEX.search(body)
      assert tool == "search" and result.ok and result.output.startswith(f"{task.answer}: ")
    else:
      result = calculate(body)
      target = task.answer if kind == "arithmetic" else re.match(r"Reach (\d+)", task.prompt)[1]
      assert tool == "calculator" and result.ok and result.output == target
    assert score(task, f"Answer: {solution.answer}") == 1.0


def test_unknown_kinds():
  with pytest.raises(ValueError, match="unknown task kind 'poetry'"):
    make_task("poetry", np.random.default_rng(0))
  with pytest.raises(ValueError, match="unknown task kind"):
    score(Task("poetry", "Write one.", "ok"), "Answer: ok")
  with pytest.raises(ValueError, match="unknown task kind"):
    solve(Task("poetry", "Write one.", "ok"))


def test_make_task_defaults_to_the_stdlib_index():
  task = make_task("docstring", np.random.default_rng(9))
  assert task == make_task("docstring", np.random.default_rng(9), INDEX)


def test_final_answer():
  assert tasks.final_answer("x\nAnswer: 12 \nAnswer: 13\nmore") == "13"
  assert tasks.final_answer("Answer:42") == "42" and tasks.final_answer("no answer") is None
  assert tasks.final_answer("answer: 42") is None  # the marker is case-sensitive
