"""LEAF benchmark JSON (Caldas et al. 2018): one record per writer/user.

A LEAF split folder (``train/`` or ``test/``) holds ``*.json`` files, each
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[...]], "y": [...]}}}``.
Each file is parsed with one ``json.load`` and each user's rows become one numpy array
in one call; the Python float lists are dropped file by file, so peak memory stays
near one file's worth of objects.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from .errors import DataError

log = logging.getLogger(__name__)

UserData = dict[str, tuple[np.ndarray, np.ndarray]]


def _user_arrays(path: Path, user: str, record: object, count: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise DataError(f"{path}: user_data[{user!r}] must be an object with 'x' and 'y'")
    try:
        x = np.asarray(record["x"], dtype=np.float32)
        y = np.asarray(record["y"], dtype=np.int64)
    except (ValueError, TypeError) as e:
        raise DataError(f"{path}: user {user!r}: x must be equal-length rows of numbers, y integers ({e})") from None
    if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"{path}: user {user!r}: x has shape {x.shape} and y {y.shape}; expected (n, d) and (n,)")
    if len(y) != count:
        raise DataError(f"{path}: user {user!r}: num_samples says {count} but the data has {len(y)}")
    return x, y


def read_file(path: Path) -> UserData:
    """One LEAF JSON file -> {user: (x float32 (n, d), y int64 (n,))}."""
    try:
        with path.open("rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable LEAF JSON file: {e}") from None
    if not isinstance(doc, dict) or not {"users", "num_samples", "user_data"} <= doc.keys():
        raise DataError(f"{path}: a LEAF file needs the keys users, num_samples and user_data")
    users, counts, data = doc["users"], doc["num_samples"], doc["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
        raise DataError(f"{path}: users and num_samples must be lists of the same length")
    out: UserData = {}
    for user, count in zip(users, counts):
        if user not in data:
            raise DataError(f"{path}: user {user!r} is listed in users but has no user_data")
        out[user] = _user_arrays(path, user, data[user], count)
    return out


def read_split(directory: Path) -> UserData:
    """All ``*.json`` files of one split folder; a user may appear in one file only."""
    start = time.perf_counter()
    merged: UserData = {}
    for path in sorted(directory.glob("*.json")):
        for user, arrays in read_file(path).items():
            if user in merged:
                raise DataError(f"{path}: user {user!r} also appears in another file of {directory}")
            merged[user] = arrays
    log.info("read %d LEAF users from %s in %.2f s", len(merged), directory, time.perf_counter() - start)
    return merged
