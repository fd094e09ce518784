"""Small NumPy references shared by several test files, written independently of moejax."""

import numpy as np


def doc_index(seg):
  """Document index per position: +1 wherever the segment id changes along a row."""
  seg = np.asarray(seg)
  doc = np.zeros(seg.shape, np.int64)
  for t in range(1, seg.shape[1]):
    doc[:, t] = doc[:, t - 1] + (seg[:, t] != seg[:, t - 1])
  return doc
