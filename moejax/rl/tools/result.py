"""What a tool answers: whether it succeeded, and the short text the model reads back."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """ok: whether the call succeeded; output: what the model reads back."""

  ok: bool
  output: str
