"""Small NumPy references and input layouts shared by several test files, written independently of
moejax."""

import numpy as np


def doc_index(seg):
  """Document index per position: +1 wherever the segment id changes along a row."""
  seg = np.asarray(seg)
  doc = np.zeros(seg.shape, np.int64)
  for t in range(1, seg.shape[1]):
    doc[:, t] = doc[:, t - 1] + (seg[:, t] != seg[:, t - 1])
  return doc


def ids_from_lengths(lengths):
  """Alternating ids 7, 3, 7, ...: a document starts where the id changes, not where an id is new."""
  return np.concatenate([np.full(n, (7, 3)[i % 2]) for i, n in enumerate(lengths)])


def doc_lengths(draw_lengths, T):
  """Documents of the drawn lengths cut to fill a row of T exactly (the last one takes the rest)."""
  lengths, total = [], 0
  for n in draw_lengths:
    n = min(n, T - total)
    if n:
      lengths.append(n)
      total += n
  if total < T:
    lengths.append(T - total)
  return lengths
