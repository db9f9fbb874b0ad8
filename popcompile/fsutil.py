"""Writing outputs so that nothing is lost: atomic files, staged folders, one writer per destination.

    atomic_write(path, data)       temp file ``.NAME.PID.tmp`` beside ``path``, then ``os.replace``
    atomic_path(path)              the same for writers that want a path (matplotlib's savefig)
    check_destination(path, flag)  before any work: the parent chain can hold ``path`` and is writable
    destination_lock(path, flag)   ``.NAME.lock`` beside ``path`` (fcntl.flock, non-blocking): a second
                                   writer fails at once with OutputError
    staged_folder(path, replace)   build in ``.NAME.PID.partial``, swap in only when complete

Readers never see a half-written file: every name appears through one rename. A process killed with
SIGKILL can leave ``.NAME.PID.partial`` behind; the next ``staged_folder`` for that destination removes
those whose process is gone. SIGINT and SIGTERM (the CLI raises on both) run the cleanup themselves.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from .errors import OutputError

_RENAME_EXCHANGE = 2  # linux/fs.h: swap two existing paths in one step
_AT_FDCWD = -100
#: write failures the user can fix (space, quota, permissions, a read-only disk): OutputError, not a traceback
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and one ``os.replace``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` (same suffix) to write; renamed onto ``path`` if the body completes."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        with user_write_errors(path):
            yield tmp
            with open(tmp, "rb+") as handle:  # on disk before the rename makes it visible
                os.fsync(handle.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def user_write_errors(path: Path) -> Iterator[None]:
    """A full disk, a quota or a permission while writing ``path``: OutputError naming it (other OSErrors
    are bugs)."""
    try:
        yield
    except OSError as err:
        if err.errno not in _USER_ERRNOS:
            raise
        raise OutputError(f"cannot write {path}: {err.strerror} ({err.filename or path}): free space or "
                          "choose another destination; nothing was replaced") from err


def check_destination(path: str | Path, flag: str = "--out") -> None:
    """OutputError unless ``path`` can be created: no file in its parent chain, the nearest folder
    writable."""
    path = Path(path).absolute()
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{flag} {path}: {parent} is a file, not a folder: choose another {flag}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise OutputError(f"{flag} {path}: folder {parent} is not writable: choose another {flag}")
            return


# locks this process holds: taking one again (export inside the CLI's lock) is a no-op
_HELD: set[Path] = set()


@contextlib.contextmanager
def destination_lock(path: str | Path, flag: str = "--out") -> Iterator[None]:
    """Hold ``.NAME.lock`` beside ``path`` for the body; OutputError at once if another process holds it."""
    path = Path(path).absolute()
    lock = path.with_name(f".{path.name}.lock")
    if lock in _HELD:
        yield
        return
    check_destination(path, flag)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(lock, path, flag)
    except OSError as err:
        raise OutputError(f"{flag} {path}: cannot create the lock file {lock} ({err.strerror or err}): "
                          f"choose another {flag}") from None
    _HELD.add(lock)
    try:
        yield
    finally:
        _HELD.discard(lock)
        # before the unlock: a waiter that opened this inode retries on a fresh one
        lock.unlink(missing_ok=True)
        os.close(fd)


def _acquire(lock: Path, path: Path, flag: str) -> int:
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(f"{flag} {path} is being written by another popcompile "
                              f"(pid {owner}, lock {lock}): "
                              f"wait for it to finish or choose another {flag}") from None
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:  # still the live lock file, not one just released
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        os.close(fd)


@contextlib.contextmanager
def staged_folder(path: str | Path, *, replace: bool = False) -> Iterator[Path]:
    """A fresh ``.NAME.PID.partial`` beside ``path`` to fill; it becomes ``path`` only if the body completes.

    ``replace``: an existing ``path`` is swapped out in one rename (renameat2 RENAME_EXCHANGE) and then
    deleted; without it an existing ``path`` is an OutputError. The caller decides what may be replaced
    and holds ``destination_lock``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # ours from an earlier call in this process
    try:
        with user_write_errors(path):
            tmp.mkdir(mode=0o755)
            yield tmp
            _swap_in(tmp, path, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a failure: the partial; after a swap: the old folder


def _swap_in(tmp: Path, path: Path, replace: bool) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    if not replace:
        raise OutputError(f"{path} appeared while exporting: choose another --out or pass --force")
    if not _exchange(tmp, path):  # no renameat2 here: two renames, the old folder kept until the second
        old = path.with_name(f".{path.name}.{os.getpid()}.old")
        os.rename(path, old)
        os.rename(tmp, path)
        os.rename(old, tmp)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def remove_stale(path: str | Path) -> list[Path]:
    """Delete ``.NAME.PID.partial`` folders beside ``path`` whose process is gone (killed with SIGKILL)."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.partial$")
    removed = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not entry.is_symlink() and not _alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
