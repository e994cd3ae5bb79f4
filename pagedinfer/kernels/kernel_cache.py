"""The folder of compiled kernels, and the checks that make loading a library from it safe.

A library loaded from the cache runs as the user: a folder another local user can write (the old
default, ``<tmp>/pagedinfer-kernels``, could be created first by anyone) lets them plant code in
the next run. So, as pip and ccache keep theirs, the cache is per user (``$XDG_CACHE_HOME/pagedinfer/
kernels``, default ``~/.cache/pagedinfer/kernels``; ``PAGEDINFER_CACHE`` overrides), the folders
created for it are private (0o700), and a folder or library that another user owns or could write is
refused (`KernelCacheError`, one line naming the path and the fix) rather than worked around: a shared
cache is a setup to fix, and a private temporary one would recompile every kernel on every run.

What is checked: the cache folder and every library before it is loaded are the user's and not
writable by group or others; every folder above the cache belongs to the user or root and is
writable by group or others only with the sticky bit (as ``/tmp``), so no one else can rename the
cache away between the check and the load. Libraries are built under a temporary name in the cache
and renamed into place, made private (0o700) before, so a half-written one is never loaded.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pagedinfer import envs

PRIVATE = 0o700


class KernelCacheError(RuntimeError):
    """The cache cannot be used: another user could have written it (or a library in it), or it
    cannot be created; the message is one line naming the path and the fix."""


def folder(sub: str | None = None) -> Path:
    """The kernel cache (or its ``sub`` folder), created private where missing, and checked."""
    root = Path(os.path.abspath(envs.kernel_cache()))
    path = root if sub is None else root / sub
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            p.mkdir(mode=PRIVATE)
        except FileExistsError:
            pass  # made meanwhile by another run: checked below like any folder found
        except OSError as e:
            raise KernelCacheError(
                f"cannot create the kernel cache {path}: {e.strerror} ({p}); set PAGEDINFER_CACHE to a "
                "folder you can write"
            ) from None
    for p in reversed(root.parents):
        _check_above(p)
    for p in dict.fromkeys((root, path)):
        _check_own(p, "the kernel cache", "chmod go-w {path}")
    return path


def library(path: Path) -> Path:
    """``path``, a library about to be loaded, once it is checked to be the user's alone."""
    _check_own(path, "the compiled kernel", "delete it (it is built again)")
    return path


def seal(tmp: Path, path: Path) -> Path:
    """A library built at ``tmp`` made private and renamed to ``path`` (atomically: a run never loads a
    half-written one); ``path``."""
    os.chmod(tmp, PRIVATE)
    os.replace(tmp, path)
    return path


def _check_own(path: Path, what: str, fix: str) -> None:
    st = path.stat()
    fix = fix.format(path=path)
    if st.st_uid != os.geteuid():
        raise KernelCacheError(
            f"{what} {path} belongs to another user (uid {st.st_uid}): a library placed there would run "
            f"as you; set PAGEDINFER_CACHE to a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelCacheError(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): a library "
            f"placed there would run as you; {fix}, or set PAGEDINFER_CACHE to a folder of your own"
        )


def _check_above(path: Path) -> None:
    st = path.stat()
    shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX
    if st.st_uid not in (0, os.geteuid()) or shared:
        raise KernelCacheError(
            f"the kernel cache {envs.kernel_cache()} is inside {path}, which "
            + ("another user owns" if st.st_uid not in (0, os.geteuid()) else "other users can write")
            + f" (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): they could replace the cache; "
            "set PAGEDINFER_CACHE to a folder of your own"
        )
