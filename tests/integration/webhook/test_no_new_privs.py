"""What the webhook's ``allowPrivilegeEscalation: false`` does to a setuid-root binary (issue 38 row 2),
on the real kernel: the runtime turns the field into no_new_privs for the container's processes.

Under Pod Security ``baseline`` / ``restricted`` the sidecar runs as the GPU containers' user, so
a process that became root would be out of its reach. With no_new_privs the exec of a setuid-root
binary still succeeds, and the program runs with its caller's uid (docs/policy.md, "Side doors");
without it (the control) the same binary runs with effective uid 0.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.prerequisites import needs

pytestmark = [
    needs(os.geteuid() == 0, reason="needs root to make a setuid-root binary and drop to another user"),
    needs(shutil.which("setpriv") is not None, reason="needs setpriv (util-linux)"),
    needs(shutil.which("id") is not None, reason="needs id (coreutils)"),
]

USER = ("setpriv", "--reuid=1000", "--regid=1000", "--clear-groups")


@pytest.fixture
def setuid_id() -> Iterator[Path]:
    """A setuid-root copy of id(1), in a directory uid 1000 can reach (pytest's tmp_path is root's 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="gpufence-setuid-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        binary = directory / "id"
        shutil.copy2(str(shutil.which("id")), binary)
        os.chown(binary, 0, 0)
        binary.chmod(0o755 | stat.S_ISUID)
        yield binary
    finally:
        shutil.rmtree(directory)


def ids(binary: Path, *prefix: str) -> str:
    """id(1)'s own words: ``euid=`` appears only where the effective uid differs from the real one."""
    return subprocess.run([*prefix, str(binary)], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def test_a_setuid_root_binary_runs_as_its_caller_under_no_new_privs(setuid_id: Path) -> None:
    control = ids(setuid_id, *USER)
    assert control.startswith("uid=1000") and "euid=0(" in control, control  # setuid makes it root
    confined = ids(setuid_id, *USER, "--no-new-privs")  # the exec succeeds, as uid 1000 alone
    assert confined.startswith("uid=1000") and "euid=" not in confined, confined
