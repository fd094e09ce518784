"""Passkey retrieval: a five-digit number stated once at a depth of a long filler text, asked for at the
end and answered greedily. A prompt is built in token ids to exactly its length:

    BOS intro | filler (depth of it) | needle | filler (the rest) | question

and an answer is right when the first number in the generated text is the key.
"""

import re
from collections.abc import Callable

import numpy as np

from moejax.inference.conversation import generate

INTRO = "A pass key is hidden somewhere in the long text below. Find it and keep it in mind.\n"
FILLER = "The river runs past the mill and the carts roll down the hill. The day goes on as the one before.\n"
NEEDLE = "The pass key is {key}. Keep it in mind: {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"

# answer(prompts, max_new_tokens) -> the generated ids of each prompt
Answer = Callable[[list[list[int]], int], list[list[int]]]


def prompt(tokenizer, length: int, depth: float, key: str) -> tuple[list[int], int]:
  """(the prompt's `length` ids, the index where the needle starts)."""
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1], got {depth}")
  intro = tokenizer.encode(INTRO)
  needle = tokenizer.encode(NEEDLE.format(key=key), bos=False)
  question = tokenizer.encode(QUESTION, bos=False)
  room = length - len(intro) - len(needle) - len(question)
  if room < 0:
    raise ValueError(f"a passkey prompt needs at least {length - room} tokens with this tokenizer, "
                     f"got {length}")
  sentence = tokenizer.encode(FILLER, bos=False)
  filler = (sentence * (room // len(sentence) + 1))[:room]
  before = int(round(depth * room))
  ids = intro + filler[:before] + needle + filler[before:] + question
  return ids, len(intro) + before


def greedy_answer(lm) -> Answer:
  return lambda prompts, n: [list(t) for t in generate(lm, prompts, max_new_tokens=n).tokens]


def first_number(text: str) -> str | None:
  match = re.search(r"\d+", text)
  return None if match is None else match.group(0)


def passkey_accuracy(lm, lengths: list[int], depths: list[float], *, trials: int = 1, seed: int = 0,
                     answer: Answer | None = None, batch: int = 4) -> dict:
  """{"lengths": [{"length", "accuracy", "depths": [{"depth", "accuracy", "answers"}]}], "accuracy"}: each
  (length, depth) asked `trials` times with its own key. `answer` defaults to the model's greedy
  generation."""
  if lm.tokenizer is None:
    raise ValueError("passkey needs a model with a text tokenizer: this run trained on synthetic ids")
  if trials < 1:
    raise ValueError(f"trials must be >= 1, got {trials}")
  answer = greedy_answer(lm) if answer is None else answer
  rng = np.random.default_rng(seed)
  max_new = len(lm.tokenizer.encode(" 99999.", bos=False)) + 2
  cells = []  # (length, depth, key, prompt)
  for length in lengths:
    for depth in depths:
      for _ in range(trials):
        key = str(rng.integers(10_000, 100_000))
        cells.append((length, depth, key, prompt(lm.tokenizer, length, depth, key)[0]))
  texts = []
  for at in range(0, len(cells), batch):
    group = cells[at:at + batch]
    texts += [lm.tokenizer.decode(ids) for ids in answer([c[3] for c in group], max_new)]
  right = [first_number(t) == c[2] for c, t in zip(cells, texts, strict=True)]
  table = []
  for length in lengths:
    rows = []
    for depth in depths:
      picked = [i for i, c in enumerate(cells) if c[0] == length and c[1] == depth]
      rows.append({"depth": depth, "accuracy": float(np.mean([right[i] for i in picked])),
                   "answers": [texts[i] for i in picked]})
    table.append({"length": length, "accuracy": float(np.mean([r["accuracy"] for r in rows])),
                  "depths": rows})
  return {"lengths": table, "accuracy": float(np.mean(right))}
