"""File operations on a local path or an object-store URL (s3://bucket/key, gs://bucket/key).

Local paths go through `os`; URLs through fsspec (s3fs for s3://, gcsfs for gs://, installed
separately). The S3 endpoint, region and credentials come from the usual AWS environment variables
(AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3 for a non-AWS server, AWS_REGION, AWS_ACCESS_KEY_ID, ...).

Writes are whole or not at all: locally a temporary file renamed into place, in an object store a
single PUT, which replaces the object atomically.

Object stores have no append, and TensorBoard and the metrics log append all the time: a run whose
workdir is a URL writes those into a local `Mirror` and uploads what changed at each checkpoint and
at the end, and a resumed run first downloads them into the mirror.
"""

import hashlib
import os
import posixpath
import re
import shutil

import fsspec

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")


def is_url(path) -> bool:
  return bool(_URL.match(os.fspath(path)))


def resolve_workdir(workdir) -> str:
  """An absolute local path (~ expanded) for a local workdir; a URL (gs://, s3://, ...) unchanged.

  Orbax refuses relative checkpoint paths, and a relative path would also change meaning if anything
  changed the working directory during the run."""
  workdir = os.fspath(workdir)
  if is_url(workdir):
    return workdir.rstrip("/")
  return os.path.abspath(os.path.expanduser(workdir))


def join(base: str, *parts: str) -> str:
  return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def _fs(path: str):
  if is_url(path):
    return fsspec.core.url_to_fs(path)
  return fsspec.filesystem("file"), path


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  fs, p = _fs(path)
  return fs.exists(p)


def makedirs(path: str) -> None:
  """A local directory; nothing for a URL (object stores have no directories)."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
  if not is_url(path):
    with open(path) as f:
      return f.read()
  fs, p = _fs(path)
  with fs.open(p, "r") as f:
    return f.read()


def write_text(path: str, text: str) -> None:
  """Written whole or not at all: a kill mid-write leaves the old file."""
  if not is_url(path):
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)
    return
  fs, p = _fs(path)
  fs.pipe_file(p, text.encode())


def move(source: str, target: str) -> None:
  """Moves a file or a folder (every object under a prefix, on an object store)."""
  if not is_url(source):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(source, target)
    return
  fs, p = _fs(source)
  fs.mv(p, _fs(target)[1], recursive=True)


def upload(local_path: str, path: str) -> None:
  """Copies a local file to `path` (local or URL), whole or not at all."""
  if not is_url(path):
    shutil.copyfile(local_path, path + ".tmp")
    os.replace(path + ".tmp", path)
    return
  fs, p = _fs(path)
  fs.put_file(local_path, p)


def download(path: str, local_path: str) -> bool:
  """Copies `path` to a local file; False (and nothing written) where `path` does not exist."""
  if not exists(path):
    return False
  _get(*_fs(path), local_path)
  return True


def _get(fs, path: str, local_path: str) -> None:
  os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
  fs.get_file(path, local_path + ".tmp")
  os.replace(local_path + ".tmp", local_path)


def mirror_root() -> str:
  root = os.environ.get("MOEJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "moejax")
  return os.path.join(root, "mirror")


class Mirror:
  """A local directory standing for `url`: files are written locally, and `push` uploads those that
  changed since the last push. For a local workdir it is the workdir itself, and push does nothing.

  `pull(names)` first downloads the given files and every file under the given directories (a
  trailing "/") from the URL, for a resumed run to append to."""

  def __init__(self, workdir: str):
    self.url = workdir if is_url(workdir) else None
    if self.url is None:
      self.local = workdir
    else:
      digest = hashlib.sha256(workdir.encode()).hexdigest()[:16]
      name = re.sub(r"[^A-Za-z0-9_.-]+", "_", workdir.split("://", 1)[1])[-80:]
      self.local = os.path.join(mirror_root(), f"{name}-{digest}")
    os.makedirs(self.local, exist_ok=True)
    self._pushed: dict[str, tuple[int, int]] = {}

  def pull(self, names) -> None:
    if self.url is None:
      return
    fs, root = _fs(self.url)
    for name in names:
      if name.endswith("/"):
        if not fs.exists(posixpath.join(root, name)):
          continue
        for remote in fs.find(posixpath.join(root, name)):  # listed, so no existence check per file
          _get(fs, remote, os.path.join(self.local, posixpath.relpath(remote, root)))
      else:
        download(join(self.url, name), os.path.join(self.local, name))
    self._pushed = self._stamps()  # what came from the URL is there already

  def _stamps(self) -> dict[str, tuple[int, int]]:
    stamps = {}
    for folder, _, files in os.walk(self.local):
      for file in files:
        if file.endswith(".tmp"):
          continue
        path = os.path.join(folder, file)
        st = os.stat(path)
        stamps[os.path.relpath(path, self.local)] = (st.st_size, st.st_mtime_ns)
    return stamps

  def push(self) -> None:
    if self.url is None:
      return
    stamps = self._stamps()
    for relative, stamp in stamps.items():
      if self._pushed.get(relative) != stamp:
        upload(os.path.join(self.local, relative), join(self.url, *relative.split(os.sep)))
    self._pushed = stamps
