"""The tools of a run, its tasks, and the generated tool-use demonstrations that SFT learns the format from.

A demonstration is written in the rollouts' own format and tokenised the same way: the task and each
tool result enter as context, each reply (a tool call or the final "Answer: ...", then EOS) as the
policy's tokens, each piece encoded on its own. SFT's loss reads only the replies.
"""

import functools

import numpy as np

from moejax.data import tokenizer as tk
from moejax.inference.loading import TextTokenizer
from moejax.rl import tasks as tasks_lib
from moejax.rl.env import RESULT_CHARS, ToolEnv, task_prompt, tool_call, tool_result
from moejax.rl.tools.calculator import calculate
from moejax.rl.tools.sandbox import run_python
from moejax.rl.tools.search import DocIndex
from moejax.rl.transcript import Transcript

DEMONSTRATION = -2  # the version of a demonstration's tokens: no policy of the run drew them


def make_tools(rl_cfg) -> dict:
  """{name: callable(text) -> ToolResult} of rl.tools."""
  makers = {"calculator": lambda: calculate,
            "python": lambda: functools.partial(run_python, timeout_s=float(rl_cfg.python_timeout_s)),
            "search": lambda: (lambda query: DocIndex.from_stdlib().search(query))}
  return {name: makers[name]() for name in rl_cfg.tools}


def make_env_factory(rl_cfg):
  tools = make_tools(rl_cfg)
  return lambda: ToolEnv(tools, max_turns=int(rl_cfg.max_turns))


def draw_task(rl_cfg, rng: np.random.Generator) -> tasks_lib.Task:
  kind = rl_cfg.tasks[int(rng.integers(len(rl_cfg.tasks)))]
  if kind == "arithmetic":
    return tasks_lib.arithmetic(rng, tuple(rl_cfg.arithmetic_digits))
  return tasks_lib.make_task(kind, rng)


def reply_texts(task, tools, direct: bool) -> list[tuple[str, str | None]]:
  """[(reply text, the tool result that answers it or None)] of the reference solution; `direct`:
  the answer alone, no tool call."""
  solution = tasks_lib.solve(task)
  replies = []
  if not direct:
    for name, body in solution.tool_calls:
      if name not in tools:
        raise ValueError(f"task {task.kind!r} needs the {name!r} tool, which rl.tools leaves out")
      replies.append((tool_call(name, body), tool_result(tools[name](body).output[:RESULT_CHARS])))
  replies.append((f"Answer: {solution.answer}", None))
  return replies


def demonstration_texts(rl_cfg, seed: int) -> list[tuple[tasks_lib.Task, list[tuple[str, str | None]]]]:
  """rl.sft.examples tasks with their replies, a share rl.sft.direct_fraction answering directly."""
  rng = np.random.default_rng([seed, 1])
  tools = make_tools(rl_cfg)
  out = []
  for _ in range(int(rl_cfg.sft.examples)):
    task = draw_task(rl_cfg, rng)
    out.append((task, reply_texts(task, tools, bool(rng.random() < rl_cfg.sft.direct_fraction))))
  return out


def tokenize_demonstration(tokenizer: TextTokenizer, task, replies) -> Transcript:
  t = Transcript()
  t.add_context(tokenizer.encode(task_prompt(task), bos=True))
  for reply, result in replies:
    ids = tokenizer.encode(reply, bos=False) + [tokenizer.eos_id]
    t.add_policy(ids, [0.0] * len(ids), DEMONSTRATION)
    if result is not None:
      t.add_context(tokenizer.encode(result, bos=False))
  return t


def train_rl_tokenizer(rl_cfg, demonstrations) -> TextTokenizer:
  """A byte-level BPE (moejax.data.tokenizer) of rl.tokenizer_vocab ids trained on the demonstrations'
  text, for a run that starts from fresh weights; digits are tokens of their own, so that copying a
  number from the task into a tool call, or from a result into the answer, copies the same ids."""
  texts = [task_prompt(task) + "".join(reply + (result or "") for reply, result in replies)
           for task, replies in demonstrations]
  return TextTokenizer(tk.train_tokenizer(texts, int(rl_cfg.tokenizer_vocab), individual_digits=True))
