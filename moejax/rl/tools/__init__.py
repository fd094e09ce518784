"""The tools an agent calls by text: each takes the call's input text and returns a `ToolResult`."""

from moejax.rl.tools.calculator import calculate
from moejax.rl.tools.result import ToolResult
from moejax.rl.tools.sandbox import run_python
from moejax.rl.tools.search import DocIndex

__all__ = ["DocIndex", "ToolResult", "calculate", "run_python"]
