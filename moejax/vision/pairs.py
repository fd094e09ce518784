"""Image-text pairs listed in JSONL files: one JSON object a line, naming an image and giving its text.

  {"image": "photos/cat.jpg", "text": "a cat asleep on a chair."}

A relative image path is taken from the JSONL file's folder (so a folder of images and its listing can be
moved or copied to a bucket together); absolute paths and URLs are used as given.

The two kinds of failure are told apart. A malformed line (not JSON, not an object, a field missing, of the
wrong type, or empty) is a bug in whatever wrote the file: it raises, naming the file and line, since fixing
it is cheap and skipping it would hide it. A bad image (corrupt, empty, missing, oversized) is what large
collections always hold: it is skipped and counted in the SkipLog.
"""

import json
import os
import posixpath
from collections.abc import Iterator

import fsspec

from moejax.vision.examples import ImageText
from moejax.vision.images import BadImage, SkipLog, read_image

_GLOB_CHARS = "*?["


def find_jsonl(path: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
  """The files that `path` names, sorted: a file, a glob, or a folder (every *.jsonl file under it, hidden
  ones left out). ValueError if there are none."""
  fs, root = fsspec.core.url_to_fs(path)
  if any(ch in root for ch in _GLOB_CHARS):
    files = [p for p in fs.glob(root) if fs.isfile(p)]
  elif fs.isdir(root):
    files = [p for p in fs.find(root) if p.endswith(".jsonl")
             and not any(part.startswith(".") for part in posixpath.relpath(p, root).split("/"))]
  elif fs.exists(root):
    files = [root]
  else:
    raise ValueError(f"image-text pairs {path!r}: no such file, folder or glob match")
  if not files:
    raise ValueError(f"image-text pairs {path!r} match no files")
  return fs, sorted(files)


def list_pairs(path: str, *, image_field: str = "image", text_field: str = "text"
               ) -> list[tuple[str, str, str]]:
  """(where "file:line", resolved image path, text) of every line of the JSONL files of `path` (find_jsonl),
  in file then line order, without opening any image; raises ValueError ("file:line: ...") on a
  malformed line. Blank lines are allowed and ignored. Compressed files (.gz, ...) are read through
  fsspec's compression inference."""
  fs, files = find_jsonl(path)
  out = []
  for file in files:
    with fs.open(file, "rb", compression="infer") as f:
      for lineno, raw in enumerate(f, start=1):
        if not raw.strip():
          continue
        where = f"{file}:{lineno}"
        image_path, text = _parse_line(raw, where, image_field, text_field)
        out.append((where, _resolve(fs, file, image_path), text))
  return out


def read_pairs(path: str, *, image_field: str = "image", text_field: str = "text", max_decode_pixels: int,
               skips: SkipLog) -> Iterator[ImageText]:
  """Yields ImageText(kind "pairs", label {}) for each line that `list_pairs` lists, skipping through
  `skips` the lines whose image is bad."""
  for where, resolved, text in list_pairs(path, image_field=image_field, text_field=text_field):
    try:
      image = read_image(resolved, max_decode_pixels=max_decode_pixels)
    except BadImage as e:
      skips.skip(e.reason, f"{where} ({e.detail})")
      continue
    yield ImageText(image, text, "pairs", {})


def _parse_line(raw: bytes, where: str, image_field: str, text_field: str) -> tuple[str, str]:
  """(image path, text) of one non-blank line, or ValueError naming `where`."""
  try:
    line = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{where}: not UTF-8 ({e})") from None
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not a JSON line ({e})") from None
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  values = []
  for field in (image_field, text_field):
    if field not in record:
      raise ValueError(f"{where}: no {field!r} field (fields: {sorted(record)})")
    value = record[field]
    if not isinstance(value, str):
      raise ValueError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
      raise ValueError(f"{where}: field {field!r} is empty")
    values.append(value)
  return values[0], values[1]


def _resolve(fs: fsspec.AbstractFileSystem, jsonl: str, image: str) -> str:
  """An image path as read_image takes it: URLs and absolute paths as given, relative ones from the JSONL
  file's folder, on the JSONL file's filesystem."""
  if "://" in image or image.startswith("/") or os.path.isabs(image):
    return image
  folder = posixpath.dirname(jsonl)
  protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
  if "file" in protocols:
    return os.path.join(folder, image)
  return posixpath.join(fs.unstrip_protocol(folder), image)
