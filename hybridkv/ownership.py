"""Ownership checks for what this server trusts on disk, on a host shared with other users: a directory another
user can write to (or swap, through a directory above it) lets them plant what we load or serve.

Invariant of a trusted path: it belongs to this user, no one else may write to it, and every directory above it
belongs to this user or root and is writable by no one else unless sticky (as /tmp is: there only a file's owner
may rename or delete it). The disk tier (`connectors/private_dir.py`) and the lazily built native kernels
(`native.py`) both check this before use.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Unsafe:
    """Why `path` cannot be trusted: `reason` is "owner" (another user owns it) or "writable" (others may write)."""

    path: Path
    reason: str
    uid: int
    mode: int  # permission bits

    def describe(self) -> str:
        if self.reason == "owner":
            return f"{self.path} belongs to uid {self.uid}, not to this user (uid {os.geteuid()}) or root"
        return f"other users may write to {self.path} (mode {self.mode:o}, not sticky)"


def unsafe_ancestor(path: Path) -> Unsafe | None:
    """The first existing directory from `path` up to / that is neither ours nor root's, or that others may write
    to without the sticky bit; None when there is none. Missing directories are skipped (their creator decides);
    OSError other than a missing one propagates."""
    me = os.geteuid()
    here = Path(os.path.abspath(path))
    for d in (here, *here.parents):
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue
        if st.st_uid not in (me, 0):
            return Unsafe(d, "owner", st.st_uid, stat.S_IMODE(st.st_mode))
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            return Unsafe(d, "writable", st.st_uid, stat.S_IMODE(st.st_mode))
    return None


def unsafe_own(path: Path, st: os.stat_result) -> Unsafe | None:
    """Whether `st` (of `path`, taken without following a link) is ours alone: owned by this user and not
    group/other-writable, whatever its sticky bit."""
    if st.st_uid != os.geteuid():
        return Unsafe(path, "owner", st.st_uid, stat.S_IMODE(st.st_mode))
    if stat.S_IMODE(st.st_mode) & 0o022:
        return Unsafe(path, "writable", st.st_uid, stat.S_IMODE(st.st_mode))
    return None
