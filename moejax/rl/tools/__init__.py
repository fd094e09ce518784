from moejax.rl.tools.result import ToolResult
from moejax.rl.tools.sandbox import run_python
