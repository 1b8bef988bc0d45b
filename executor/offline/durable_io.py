"""Files that survive a crash: JSONL lines written whole and synced, other files replaced atomically.

A kill can still cut the last line of a JSONL file short (the write was under way); readers here
find such a torn tail so that a resumed run can drop it instead of tripping over it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class OutputWriteError(OSError):
    """A result file could not be written (disk full, folder gone); the message names the file."""


def write_error(path: Path, exc: OSError) -> OutputWriteError:
    reason = exc.strerror or str(exc)
    return OutputWriteError(exc.errno or errno.EIO, f"cannot write {path}: {reason}")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: a reader (or a crash) sees the old file or the new one."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        _fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        raise write_error(path, exc) from None


def remove_durably(paths: Iterable[Path]) -> None:
    """Delete the files, and make their removal durable (one fsync of each folder)."""
    folders = set()
    for path in paths:
        try:
            path.unlink(missing_ok=True)
            folders.add(path.parent)
        except OSError as exc:
            raise write_error(path, exc) from None
    for folder in folders:
        _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LineAppender:
    """Appends one JSON object per line, each in a single write; with `sync`, fsynced before returning.

    When a write fails part-way (a full disk), the file is cut back to its last whole line, so the
    lines already there stay readable.
    """

    def __init__(self, path: Path, sync: bool) -> None:
        self.path = path
        self.sync = sync
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise write_error(path, exc) from None

    def append(self, obj: dict[str, Any]) -> None:
        self.append_all([obj])

    def append_all(self, objs: Iterable[dict[str, Any]]) -> None:
        """Append each object as one line in one write; with `sync`, fsync once after the last. When a
        write fails, the file is cut back to what it held before this call."""
        size_before = os.fstat(self._fd).st_size
        try:
            for obj in objs:
                data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
                written = os.write(self._fd, data)
                if written != len(data):
                    raise OSError(errno.ENOSPC, f"only {written} of {len(data)} bytes written")
            if self.sync:
                os.fsync(self._fd)
        except OSError as exc:
            with contextlib.suppress(OSError):  # if this fails too, the next run drops the torn line
                os.ftruncate(self._fd, size_before)
            raise write_error(self.path, exc) from None

    def close(self) -> None:
        os.close(self._fd)


@dataclass(slots=True)
class JsonlContents:
    lines: list[dict[str, Any]]  # the whole, parsed lines
    good_size: int  # bytes up to the end of the last whole line
    torn_tail: bytes  # what follows: a line a crash cut short (empty when none)


class CorruptLineError(ValueError):
    """A line before the last one is not a JSON object: not the trace of a crash, so not repaired."""


def read_jsonl(path: Path) -> JsonlContents:
    """Parse a JSONL file written by LineAppender; a last line without its newline or not JSON is torn."""
    data = path.read_bytes() if path.exists() else b""
    whole = data[: data.rfind(b"\n") + 1]
    try:  # the common case, every line whole: one pass
        parsed = [json.loads(raw) for raw in whole.splitlines()]
        if {type(line) for line in parsed} <= {dict}:
            return JsonlContents(parsed, len(whole), data[len(whole) :])
    except ValueError:  # UnicodeDecodeError too
        pass
    lines: list[dict[str, Any]] = []  # a line is not a JSON object: find which, and whether it is the last
    position = 0
    while position < len(data):
        end = data.find(b"\n", position)
        line = _parse_line(data[position:end]) if end != -1 else None
        if line is None:
            if end != -1 and data.find(b"\n", end + 1) != -1:
                line_no = data.count(b"\n", 0, position) + 1
                raise CorruptLineError(f"{path}:{line_no}: not a JSON object; the file was changed by hand?")
            break
        lines.append(line)
        position = end + 1
    return JsonlContents(lines, position, data[position:])


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def drop_torn_tail(path: Path, contents: JsonlContents) -> None:
    """Cut the file back to its last whole line."""
    if contents.torn_tail:
        try:
            os.truncate(path, contents.good_size)
        except OSError as exc:
            raise write_error(path, exc) from None
