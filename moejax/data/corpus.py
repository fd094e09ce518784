"""Finding and reading the raw documents of a corpus.

A corpus is a sorted list of files under a root: the interpreter's standard-library `.py` sources
for the embedded default (`source="stdlib"`, read from disk, no download), or any local path,
glob or fsspec URL (gs:// and s3:// need gcsfs / s3fs installed). Compressed files (.gz, .bz2,
...) are read through fsspec's compression inference.

Every document has a stable key: the file's path relative to the root for text files, and
`path:line` for JSONL records. The key alone decides the train/validation split, so adding
files never moves another document across splits.
"""

import dataclasses
import json
import os
import posixpath
import sysconfig
from collections.abc import Iterator

import fsspec

STDLIB = "stdlib"
# Test suites are large, repetitive and full of deliberately odd encodings; the rest of the
# standard library is ordinary, well-formed Python.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                               "idle_test"})
_GLOB_CHARS = "*?["
# fsspec backends name the "content changed" stamp differently; the first one present is used.
_STAMP_KEYS = ("mtime", "updated", "LastModified", "last_modified", "ETag", "etag", "md5Hash",
               "created")


@dataclasses.dataclass(frozen=True)
class SourceFile:
  rel: str  # path relative to the corpus root, '/'-separated: the split key
  path: str  # what `fs.open` takes
  size: int
  stamp: str  # modification time or etag, so a listing fingerprint notices edits


@dataclasses.dataclass(frozen=True)
class Corpus:
  source: str
  fs: fsspec.AbstractFileSystem
  root: str
  files: tuple[SourceFile, ...]

  def listing(self) -> list[tuple[str, int, str]]:
    """What the cache fingerprint hashes: cheap to get (no file is read)."""
    return [(f.rel, f.size, f.stamp) for f in self.files]


@dataclasses.dataclass(frozen=True)
class Document:
  key: str
  text: str


def find_corpus(source: str) -> Corpus:
  """Lists the files of `source`, sorted by relative path; ValueError if there are none."""
  if source == STDLIB:
    return _stdlib_corpus()
  fs, path = fsspec.core.url_to_fs(source)
  if any(ch in path for ch in _GLOB_CHARS):
    infos = fs.glob(path, detail=True)
    root = path[:min(path.index(ch) for ch in _GLOB_CHARS if ch in path)].rsplit("/", 1)[0]
  elif fs.isdir(path):
    infos = fs.find(path, detail=True)
    root = path
  elif fs.exists(path):
    infos = {path: fs.info(path)}
    root = posixpath.dirname(path)
  else:
    raise ValueError(f"data source {source!r} does not exist")
  files = []
  for p, info in sorted(infos.items()):
    if info.get("type") != "file":
      continue
    rel = posixpath.relpath(p, root) if root else p
    if any(part.startswith(".") for part in rel.split("/")):
      continue  # hidden files and folders (.git, .DS_Store) are never corpus text
    files.append(SourceFile(rel, p, int(info.get("size") or 0), _stamp(info)))
  if not files:
    raise ValueError(f"data source {source!r} matches no files")
  return Corpus(source, fs, root, tuple(files))


def _stdlib_corpus() -> Corpus:
  root = sysconfig.get_paths()["stdlib"]
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
    for name in filenames:
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        st = os.stat(path)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        files.append(SourceFile(rel, path, st.st_size, str(st.st_mtime_ns)))
  if not files:
    raise ValueError(f"no .py files found in the standard library folder {root!r}")
  files.sort(key=lambda f: f.rel)
  return Corpus(STDLIB, fsspec.filesystem("file"), root, tuple(files))


def _stamp(info: dict) -> str:
  for key in _STAMP_KEYS:
    if info.get(key) is not None:
      return str(info[key])
  return ""


def iter_documents(corpus: Corpus, fmt: str, text_field: str = "text", max_files: int = 0,
                   max_bytes: int = 0) -> Iterator[Document]:
  """Yields the documents in file order, stopping after `max_files` files or once `max_bytes`
  of UTF-8 text have been yielded (0: no cap). Empty documents are skipped."""
  if fmt not in ("text", "jsonl"):
    raise ValueError(f"unknown data format {fmt!r}: expected 'text' or 'jsonl'")
  total = 0
  for i, f in enumerate(corpus.files):
    if max_files and i >= max_files:
      return
    docs = _read_text(corpus.fs, f) if fmt == "text" else _read_jsonl(corpus.fs, f, text_field)
    for doc in docs:
      yield doc
      total += len(doc.text.encode("utf-8"))
      if max_bytes and total >= max_bytes:
        return


def _read_text(fs, f: SourceFile) -> Iterator[Document]:
  with fs.open(f.path, "rb", compression="infer") as fh:
    data = fh.read()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{f.path}: not UTF-8 text ({e})") from None
  if text:
    yield Document(f.rel, text)


def _read_jsonl(fs, f: SourceFile, text_field: str) -> Iterator[Document]:
  # Lines are split on b"\n" only: JSON strings may hold a raw U+2028, which str.splitlines cuts.
  with fs.open(f.path, "rb", compression="infer") as fh:
    for lineno, raw in enumerate(fh, 1):
      if not raw.strip():
        continue
      try:
        record = json.loads(raw)
      except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both
        raise ValueError(f"{f.path}:{lineno}: not a JSON line ({e})") from None
      if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{f.path}:{lineno}: no text field {text_field!r} (found {keys}); "
                         f"set data.text_field to the key that holds the text")
      text = record[text_field]
      if not isinstance(text, str):
        raise ValueError(f"{f.path}:{lineno}: field {text_field!r} is a {type(text).__name__}, "
                         f"not a string")
      if text:
        yield Document(f"{f.rel}:{lineno}", text)
