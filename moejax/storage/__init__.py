"""Where a run's files live: a local directory or an object store (s3://, gs://), one API for both.

`files` holds the file operations (fsspec for URLs); `orbax_s3` lets orbax write checkpoints to s3://
through TensorStore's S3 driver, as it does natively for gs://.
"""

from moejax.storage.files import (
                                  Mirror,
                                  download,
                                  exists,
                                  is_url,
                                  join,
                                  makedirs,
                                  move,
                                  read_text,
                                  resolve_workdir,
                                  upload,
                                  write_text,
)

__all__ = ["Mirror", "download", "exists", "is_url", "join", "makedirs", "move", "read_text",
           "resolve_workdir", "upload", "write_text"]
