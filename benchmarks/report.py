"""BENCHMARKS.md is shared by every benchmark: each owns one `## Title` section and replaces only it.
Also what the kernel benchmarks share around their tables: the command line and the error measure."""

import argparse
import datetime
import os
import pathlib
import re
import subprocess
import sys

import numpy as np


def replace_section(path: str, title: str, body: str, level: int = 2) -> None:
  """Writes `## title` (`###` at level 3) + body into the Markdown file, replacing that section, up to
  the next heading of its level or above, if present."""
  p = pathlib.Path(path)
  text = p.read_text() if p.exists() else "# Benchmarks\n"
  heading = "#" * level
  section = f"{heading} {title}\n\n{body.strip()}\n"
  pattern = re.compile(rf"^{heading} {re.escape(title)}\n.*?(?=^#{{1,{level}}} |\Z)", re.S | re.M)
  if pattern.search(text):
    text = pattern.sub(lambda _: section + "\n", text, count=1)
  else:
    text = text.rstrip("\n") + "\n\n" + section
  p.write_text(text.rstrip("\n") + "\n")


def commit() -> str:
  """$MOEJAX_COMMIT where set (a copy of the tree, run elsewhere, whose .git may be missing or another
  commit's), else the checkout's commit from git, with "+changes" where the tracked files differ from
  it; "unknown" without either."""
  if os.environ.get("MOEJAX_COMMIT"):
    return os.environ["MOEJAX_COMMIT"][:12]
  root = pathlib.Path(__file__).resolve().parent.parent
  try:
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # What benchmarks write (their sections, figures) is not a change to what they measure.
    dirty = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--", ".", ":!BENCHMARKS.md",
                            ":!benchmarks/figures"], check=False).returncode != 0
    return head + ("+changes" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def provenance(device_kind: str) -> list[str]:
  """A section's opening lines: the command that ran this script (as `python -m benchmarks.NAME ARGS`),
  today's date, the device and the commit."""
  module = f"benchmarks.{pathlib.Path(sys.argv[0]).stem}"
  return [f"Command: `python -m {' '.join([module, *sys.argv[1:]])}`  ",
          f"Date: {datetime.date.today()}, device: {device_kind}, commit: {commit()}.", ""]


def publish(out: str | None, title: str, lines: list[str]) -> None:
  """Prints the section and, where `out` names a file, writes it there as `## title`."""
  print("\n".join(lines))
  if out:
    replace_section(out, title, "\n".join(lines))
    print(f"wrote the '{title}' section of {out}")


def relative_error(a, b) -> float:
  """|a - b| / |b| over all elements (Frobenius norms), in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def fwd_bwd_table(rows, error_header: str) -> list[str]:
  """A kernel benchmark's table: one row per (implementation, forward ms, forward + backward ms,
  errors as text), under `| implementation | fwd ms | fwd+bwd ms | <error_header> |`."""
  return [f"| implementation | fwd ms | fwd+bwd ms | {error_header} |", "|---|---|---|---|",
          *(f"| {name} | {tf:.3f} | {tb:.3f} | {errs} |" for name, tf, tb, errs in rows)]


def kernel_benchmark_args(description: str, add_arguments=None) -> argparse.Namespace:
  """--smoke (tiny shapes on the CPU, prints only) and --out, plus what `add_arguments(parser)` adds;
  without --smoke, a GPU or exit."""
  p = argparse.ArgumentParser(description=description)
  p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; prints, times nothing real")
  p.add_argument("--out", default=None, help="markdown file to update (GPU runs)")
  if add_arguments is not None:
    add_arguments(p)
  args = p.parse_args()
  import jax

  if not args.smoke and jax.default_backend() != "gpu":
    sys.exit(f"benchmarks/{pathlib.Path(sys.argv[0]).name} needs a GPU; use --smoke on the CPU")
  return args
