"""Writing and reading PEM files for ``gpufence-certs generate``.

Private keys are created with mode 0600 from the first byte (``os.open(..., 0o600)``), never
chmod-ed afterwards. Without ``force`` an existing file is never touched: every target is checked
before anything is written (no half-written output directory) and each file is then created with
``O_EXCL``, so a file that appears in between is not clobbered either. With ``force`` each file is
written to a fresh temporary file in the same directory and renamed over the target, so a replaced
key gets mode 0600 even when the old file had a wider mode.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Kubernetes TLS Secret key names, used as file names too.
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"

PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644


class FileExistsRefused(FileExistsError):
    """A target exists and ``force`` was not given; the message names the file."""


@dataclass(frozen=True)
class OutputFile:
    name: str
    data: bytes
    private: bool

    @property
    def mode(self) -> int:
        return PRIVATE_MODE if self.private else PUBLIC_MODE


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (must not exist) with ``mode`` (before umask) and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_replace(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        _write_new(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_files(out_dir: Path, files: Sequence[OutputFile], *, force: bool = False) -> list[Path]:
    """Write ``files`` into ``out_dir`` (created with mode 0700 if missing); return the paths.

    Raises ``FileExistsRefused`` (naming the first existing file) when ``force`` is false and any
    target exists; nothing is written in that case.
    """
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    targets = [(out_dir / f.name, f) for f in files]
    if not force:
        for path, _ in targets:
            if path.exists() or path.is_symlink():
                raise FileExistsRefused(f"refusing to overwrite existing file {path} (use --force to replace it)")
    written: list[Path] = []
    for path, f in targets:
        if force:
            _write_replace(path, f.data, f.mode)
        else:
            try:
                _write_new(path, f.data, f.mode)
            except FileExistsError:
                raise FileExistsRefused(
                    f"refusing to overwrite existing file {path} (use --force to replace it)"
                ) from None
        written.append(path)
    return written


def read_file(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
