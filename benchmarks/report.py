"""BENCHMARKS.md is shared by every benchmark: each owns one `## Title` section and replaces only it."""

import pathlib
import re


def replace_section(path: str, title: str, body: str) -> None:
  """Writes `## title` + body into the Markdown file, replacing that section if present."""
  p = pathlib.Path(path)
  text = p.read_text() if p.exists() else "# Benchmarks\n"
  section = f"## {title}\n\n{body.strip()}\n"
  pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
  if pattern.search(text):
    text = pattern.sub(lambda _: section + "\n", text, count=1)
  else:
    text = text.rstrip("\n") + "\n\n" + section
  p.write_text(text.rstrip("\n") + "\n")
