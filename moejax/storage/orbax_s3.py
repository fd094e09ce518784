"""Orbax checkpoints on s3:// through TensorStore's S3 driver.

Orbax (0.12) writes arrays through TensorStore and picks its driver from the path: the native GCS
driver for gs://, the local-file driver for everything else, which turns s3://bucket/key into a
relative file path and fails. TensorStore itself has an S3 driver; `enable()` routes s3:// paths
to it by wrapping the three orbax functions that make that choice (path normalisation, the
"remote driver" test and the driver spec). The directory operations orbax does around the arrays go
through etils.epath, which already reads s3:// with s3fs.

Object stores cannot rename a directory atomically, so checkpoints on a URL are finalised as orbax
finalises them on GCS: written in place and marked complete by a commit file
(`temporary_path_class`), never renamed.

The S3 endpoint, region and credentials come from the environment, as for s3fs: AWS_ENDPOINT_URL_S3
or AWS_ENDPOINT_URL (a non-AWS server such as MinIO or a local test server), AWS_REGION or
AWS_DEFAULT_REGION, and AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY where set.
"""

import os
import posixpath

import orbax.checkpoint as ocp

from moejax.storage.files import is_url

_PREFIX = "s3://"
_enabled = False


def s3_kvstore_spec(path: str) -> dict:
  """TensorStore's kvstore spec of an s3:// path, with the endpoint and credentials of the environment."""
  bucket, _, key = path[len(_PREFIX):].partition("/")
  spec = {"driver": "s3", "bucket": bucket, "path": key}
  endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
  if endpoint:
    spec["endpoint"] = endpoint
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    spec["aws_credentials"] = {"type": "environment"}
  return spec


def enable() -> None:
  """Lets orbax write and read s3:// checkpoints (idempotent)."""
  global _enabled
  if _enabled:
    return
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

  hooks = ("_normalize_path", "_use_gcs_driver")
  if not all(hasattr(ts_utils, h) for h in hooks) or not hasattr(ts_utils.gcs_utils, "get_kvstore_for_gcs"):
    raise RuntimeError("s3:// checkpoints need orbax-checkpoint's TensorStore path hooks "
                       f"({', '.join(hooks)}, gcs_utils.get_kvstore_for_gcs), which this orbax version "
                       "lacks: pin orbax-checkpoint to a version moejax supports (pyproject.toml)")
  normalize, use_remote_driver = ts_utils._normalize_path, ts_utils._use_gcs_driver
  gcs_spec = ts_utils.gcs_utils.get_kvstore_for_gcs

  def _normalize_path(path):
    path = str(path)
    if path.startswith(_PREFIX):
      return _PREFIX + posixpath.normpath(path[len(_PREFIX):])
    return normalize(path)

  def _use_gcs_driver(directory):
    return str(directory).startswith(_PREFIX) or use_remote_driver(directory)

  def get_kvstore_for_gcs(path):
    return s3_kvstore_spec(str(path)) if str(path).startswith(_PREFIX) else gcs_spec(path)

  ts_utils._normalize_path = _normalize_path
  ts_utils._use_gcs_driver = _use_gcs_driver
  ts_utils.gcs_utils.get_kvstore_for_gcs = get_kvstore_for_gcs
  _enabled = True


def manager_options(directory: str) -> dict:
  """Extra `CheckpointManagerOptions` for a checkpoint directory: commit-file finalisation on a URL."""
  if not is_url(directory):
    return {}
  if directory.startswith(_PREFIX):
    enable()
  return {"temporary_path_class": ocp.path.atomicity.CommitFileTemporaryPath}
