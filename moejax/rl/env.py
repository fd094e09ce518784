"""Environments an agent acts in by text, and the tool-call format of its replies.

An episode: `reset(task)` gives the first observation (the task as the user states it); the agent
replies; `step(reply)` answers with the next observation, a reward and whether the episode is over.

`ToolEnv`'s format: a reply that holds `<tool name="NAME">INPUT</tool>` calls that tool and is answered
by `<result>OUTPUT</result>`; a reply without a tool call is the final answer, scored by the task's
verifier (`moejax.rl.tasks.score`: the text after its last "Answer:"). A malformed or unknown call, or
a tool that fails, is answered with an error result and the episode goes on: the agent may retry.
After `max_turns` replies the episode ends unscored (reward 0).
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Protocol

from moejax.rl import tasks as tasks_lib
from moejax.rl.tools.result import ToolResult

TOOL_CALL = re.compile(r'<tool name="([A-Za-z_][A-Za-z0-9_]*)">(.*?)</tool>', re.DOTALL)
RESULT_CHARS = 200  # a tool's output is cut to this many characters: the agent's context is short


class Env(Protocol):
  def reset(self, task) -> str:
    """Starts an episode of `task`; returns the first observation."""

  def step(self, action_text: str) -> tuple[str, float, bool, dict]:
    """(observation, reward, done, info) after the agent's reply."""


def task_prompt(task) -> str:
  return f"Task: {task.prompt}\n"


def tool_call(name: str, body: str) -> str:
  return f'<tool name="{name}">{body}</tool>'


def tool_result(output: str) -> str:
  return f"<result>{output}</result>\n"


@dataclasses.dataclass
class ToolEnv:
  """Multi-turn tool use on one task at a time. tools: {name: callable(input text) -> ToolResult}.
  info of each step: {"tool": name or None, "tool_error": bool, "turns": replies so far}."""

  tools: dict[str, Callable[[str], ToolResult]]
  max_turns: int = 4
  task: object = None
  turns: int = 0

  def __post_init__(self):
    if self.max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")

  def reset(self, task) -> str:
    self.task, self.turns = task, 0
    return task_prompt(task)

  def step(self, action_text: str) -> tuple[str, float, bool, dict]:
    if self.task is None:
      raise RuntimeError("step() before reset(): the environment has no task")
    self.turns += 1
    call = TOOL_CALL.search(action_text)
    if call is None and "<tool" not in action_text:
      return "", tasks_lib.score(self.task, action_text), True, {"tool": None, "tool_error": False,
                                                                  "turns": self.turns}
    if call is None:
      name, result = None, ToolResult(False, 'error: malformed tool call; use <tool name="NAME">INPUT</tool>')
    elif call.group(1) not in self.tools:
      name, result = call.group(1), ToolResult(False, f"error: no tool {call.group(1)!r}; tools: "
                                                      f"{', '.join(sorted(self.tools))}")
    else:
      name = call.group(1)
      result = self.tools[name](call.group(2))
    done = self.turns >= self.max_turns
    return (tool_result(result.output[:RESULT_CHARS]), 0.0, done,
            {"tool": name, "tool_error": not result.ok, "turns": self.turns})
