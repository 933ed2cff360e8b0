"""sha256 of a file, read in chunks: memory stays flat however big the file (a checkpoint, or a
file a manifest names) is. Shared by checkpoints and the manifest's source-file check."""

from __future__ import annotations

import hashlib
import os

from ckptlab.io.files import open_regular

HASH_CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
