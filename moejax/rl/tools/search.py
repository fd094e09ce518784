"""The search tool: BM25 over a small local collection of documents, answering with a short line per hit.

The collection the tasks use is built from the standard library's own source: the first paragraph of the
docstring of each public top-level function of DEFAULT_MODULES, read with `ast` (nothing is imported), named
`module.function`. It depends on the Python version's stdlib, and on nothing else.

Ranking is Okapi BM25: a document d scores, summed over the distinct words t of the query,
    idf(t) * f(t, d) * (k1 + 1) / (f(t, d) + k1 * (1 - b + b * |d| / avgdl)),
    idf(t) = log(1 + (N - n(t) + 0.5) / (n(t) + 0.5)),
with f(t, d) the count of t in d, |d| the words of d, avgdl their mean over the N documents, and n(t) the
documents that contain t. A document's words are those of its name and of its text, lower-cased runs of
letters and digits (so `make_archive` is two words). Equal scores are ordered by name.
"""

import ast
import dataclasses
import functools
import math
import os
import re
import sysconfig
from collections import Counter
from collections.abc import Iterable

from moejax.rl.tools.result import ToolResult

K1 = 1.5
B = 0.75
MAX_LINE = 160  # characters of one hit's line
# Pure-Python modules whose functions are documented in a sentence or two, present in every Python >= 3.12.
DEFAULT_MODULES = ("base64", "bisect", "calendar", "copy", "dataclasses", "difflib", "fnmatch", "functools",
                   "glob", "heapq", "html", "ipaddress", "json", "pprint", "secrets", "shlex", "shutil",
                   "statistics", "string", "tempfile", "textwrap", "urllib.parse", "uuid")

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
  """text's words, as the index counts them: lower-cased runs of ASCII letters and digits."""
  return _WORD.findall(text.lower())


def first_sentence(text: str) -> str:
  """text up to and including the first '.' that ends it or is followed by white space."""
  end = re.search(r"\.(\s|$)", text)
  return text[:end.start() + 1] if end else text


@dataclasses.dataclass(frozen=True)
class Doc:
  """One document: its name (`module.function`) and its text."""

  name: str
  text: str


class DocIndex:
  """BM25 over a collection of documents with distinct names; docs are kept sorted by name."""

  def __init__(self, docs: Iterable[Doc | tuple[str, str]], k1: float = K1, b: float = B):
    self.docs = tuple(sorted((d if isinstance(d, Doc) else Doc(*d) for d in docs), key=lambda d: d.name))
    names = [d.name for d in self.docs]
    if len(set(names)) != len(names):
      repeated = sorted(n for n, c in Counter(names).items() if c > 1)
      raise ValueError(f"document names must be distinct, repeated: {repeated}")
    self.k1, self.b = k1, b
    counts = [Counter(words(d.name) + words(d.text)) for d in self.docs]
    self._lengths = [sum(c.values()) for c in counts]
    self._average = sum(self._lengths) / len(self._lengths) if any(self._lengths) else 1.0
    self._postings: dict[str, list[tuple[int, int]]] = {}  # word -> (doc, count) for each doc that has it
    for i, c in enumerate(counts):
      for word, count in c.items():
        self._postings.setdefault(word, []).append((i, count))

  def idf(self, word: str) -> float:
    """The word's inverse document frequency, log(1 + (N - n + 0.5) / (n + 0.5))."""
    n = len(self._postings.get(word, ()))
    return math.log(1.0 + (len(self.docs) - n + 0.5) / (n + 0.5))

  def scores(self, query: str) -> dict[str, float]:
    """name -> BM25 score of each document that shares a word with the query (the others score 0)."""
    total: dict[int, float] = {}
    # Sorted, so that the sums are added in one order whatever the hash seed, and equal scores stay equal.
    for word in sorted(set(words(query))):
      idf = self.idf(word)
      for i, f in self._postings.get(word, ()):
        norm = self.k1 * (1.0 - self.b + self.b * self._lengths[i] / self._average)
        total[i] = total.get(i, 0.0) + idf * f * (self.k1 + 1.0) / (f + norm)
    return {self.docs[i].name: s for i, s in total.items()}

  def ranked(self, query: str) -> list[tuple[Doc, float]]:
    """The documents that match the query with their scores, best first, equal scores by name."""
    by_name = {d.name: d for d in self.docs}
    hits = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
    return [(by_name[name], s) for name, s in hits]

  def search(self, query: str, k: int = 1) -> ToolResult:
    """The search tool: the k best hits, a line each, `module.function: first sentence` (cut to MAX_LINE
    characters); ok=False `no match` when no document shares a word with the query."""
    if k < 1:
      raise ValueError(f"k must be at least 1, got {k}")
    if not words(query):
      return ToolResult(False, "empty query")
    hits = self.ranked(query)[:k]
    if not hits:
      return ToolResult(False, "no match")
    return ToolResult(True, "\n".join(_line(d) for d, _ in hits))

  @classmethod
  def from_stdlib(cls, modules: tuple[str, ...] = DEFAULT_MODULES) -> "DocIndex":
    """The index of the stdlib modules' function docs (built once per tuple of modules, then cached)."""
    return stdlib_index(tuple(modules))


@functools.cache
def stdlib_index(modules: tuple[str, ...]) -> DocIndex:
  """DocIndex of stdlib_docs(modules), cached: building it reads and parses every module's source."""
  return DocIndex(stdlib_docs(modules))


def stdlib_docs(modules: Iterable[str]) -> list[Doc]:
  """A Doc for each public top-level function with a docstring in the source of the given stdlib modules:
  named `module.function`, its text the docstring's first paragraph on one line. Public: not starting with
  an underscore, and listed in the module's `__all__` when it has a literal one."""
  root = sysconfig.get_paths()["stdlib"]
  docs = []
  for module in modules:
    path = os.path.join(root, *module.split(".")) + ".py"
    if not os.path.isfile(path):
      path = os.path.join(root, *module.split("."), "__init__.py")
    if not os.path.isfile(path):
      raise ValueError(f"no source file for stdlib module {module!r} under {root}")
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    public = _dunder_all(tree)
    found = {}
    for node in tree.body:
      if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")
          and (public is None or node.name in public)):
        paragraph = " ".join(re.split(r"\n\s*\n", ast.get_docstring(node) or "")[0].split())
        if paragraph:
          found[node.name] = Doc(f"{module}.{node.name}", paragraph)  # a later definition wins, as in Python
    docs.extend(found.values())
  return docs


def _dunder_all(tree: ast.Module) -> frozenset[str] | None:
  for node in tree.body:
    targets = node.targets if isinstance(node, ast.Assign) else ()
    if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
      try:
        return frozenset(ast.literal_eval(node.value))
      except (ValueError, TypeError, SyntaxError):
        return None
  return None


def _line(doc: Doc) -> str:
  line = f"{doc.name}: {first_sentence(doc.text)}"
  return line if len(line) <= MAX_LINE else line[:MAX_LINE - 3] + "..."
