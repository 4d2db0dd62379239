"""A directory only this server's user can use, on a host shared with others: the disk tier's entry directory.

`root` is created 0700 if missing, `path` (inside it) 0700. An existing `path` is checked through a descriptor
opened without following a symlink, so what is checked is what gets chmod'ed: it must be a real directory owned by
this user (else a ValueError at start-up saying what to do); group/other permission bits are removed with a
warning. `root` and every directory above it must belong to this user or to root and be writable by nobody else
unless sticky (as /tmp is): otherwise another user could rename `path` away and put their own in its place while
the server runs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from pathlib import Path

from hybridkv.ownership import unsafe_ancestor

logger = logging.getLogger(__name__)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def make_private_dir(root: Path, path: Path) -> None:
    """Create or check `path` as the module docstring says; ValueError names what to fix."""
    check_ancestors(root)
    try:
        os.makedirs(root, 0o700, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, _DIR)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and root.is_dir():
            raise ValueError(
                f"the disk offload tier's directory {path} is a symlink or not a directory: remove it "
                "(the tier recreates it) or choose another disk_path"
            ) from e
        raise ValueError(f"cannot use {root} for the disk offload tier: {e}") from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ValueError(
                f"the disk offload tier's directory {path} belongs to uid {st.st_uid}, not to this "
                f"server (uid {os.geteuid()}): remove it (another user may have planted it) or choose "
                "another disk_path"
            )
        if stat.S_IMODE(st.st_mode) & 0o077:
            logger.warning(
                "KV offload: %s had mode %o (other users could read or plant entries); setting it to 700",
                path,
                stat.S_IMODE(st.st_mode),
            )
            os.fchmod(fd, 0o700)
    except OSError as e:
        raise ValueError(f"cannot use {path} for the disk offload tier: {e}") from e
    finally:
        os.close(fd)


def check_ancestors(root: Path) -> None:
    """Each existing directory from `root` up to / is ours or root's and not writable by others unless sticky."""
    try:
        bad = unsafe_ancestor(root)
    except OSError as e:
        raise ValueError(f"cannot use {root} for the disk offload tier: {e}") from e
    if bad is not None and bad.reason == "owner":
        raise ValueError(
            f"the disk offload tier's root {root} lies under {bad.path}, which belongs to uid {bad.uid}: that user "
            "could swap the tier's directory; choose a disk_path under directories only this user or root own"
        )
    if bad is not None:
        raise ValueError(
            f"the disk offload tier's root {root} lies under {bad.path}, which other users may write to (mode "
            f"{bad.mode:o}, not sticky): they could swap the tier's directory; chmod go-w {bad.path} "
            "or choose another disk_path"
        )
