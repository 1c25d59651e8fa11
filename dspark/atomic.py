"""Whole-or-nothing file writes: a reader never sees half a file, even when the writer is killed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path`; on a clean exit it replaces `path` in one rename.

    `suffix` keeps an extension that a writer insists on (np.save appends ".npy" otherwise).
    The name carries the pid so two processes writing the same file never share a temporary.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
