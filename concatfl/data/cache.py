"""Arrays one process computed and every other process on the machine reads instead.

Decoded image trees, digits' fixed split and the partitions of a training set are computed once
per machine and kept as ``.npz`` files under ``$CONCATFL_CACHE`` (default ``~/.cache/concatfl``).
A process that finds its file never imports what computing it needs (scikit-learn, Pillow,
flwr-datasets with pandas and pyarrow): the ClientApp of a SuperNode then holds torch, Flower and
its data, not the libraries that made them.

Each file is named by a digest of everything its content depends on (the caller's `signature`),
so a changed input or setting is a different file, never a stale one. Files are written
atomically; `computed_once` lets one process compute while the others wait for its file instead
of computing it too (fifty SuperNodes starting on one machine). A cache folder that cannot be
written only costs the recomputation (with a warning).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

Arrays = dict[str, np.ndarray]


def cache_dir() -> Path:
    """``$CONCATFL_CACHE``, else ``~/.cache/concatfl``."""
    return Path(os.environ.get("CONCATFL_CACHE") or Path.home() / ".cache" / "concatfl")


def cache_path(kind: str, signature: str) -> Path:
    """The file of `kind` computed from what `signature` describes."""
    digest = hashlib.sha256(signature.encode()).hexdigest()[:24]
    return cache_dir() / f"{kind}-{digest}.npz"


def read_cache(path: Path) -> Arrays | None:
    """The arrays in `path`, or None when there is no such file."""
    if not path.is_file():
        return None
    with np.load(path) as stored:
        return dict(stored)


def write_cache(path: Path, arrays: Arrays) -> None:
    """Write atomically (other processes may read the cache concurrently); failure only warns."""
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = Path(f.name)
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        warnings.warn(f"could not write the cache file {path}: {e}", stacklevel=2)


def computed_once(path: Path, compute: Callable[[], Arrays]) -> Arrays:
    """The arrays in `path`; when there are none, `compute()`'s, written there for the others.

    While one process computes, the others wanting the same file wait for it (an exclusive lock
    on ``<path>.lock``) and then read it. Without a writable cache folder every process computes.
    """
    if (cached := read_cache(path)) is not None:
        return cached
    with _exclusive(path.with_name(path.name + ".lock")):
        if (cached := read_cache(path)) is not None:  # another process computed it meanwhile
            return cached
        arrays = compute()
        write_cache(path, arrays)
    return arrays


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive lock on the file `lock` (nothing to hold when it cannot be created)."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = lock.open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
