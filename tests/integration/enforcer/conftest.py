"""The ``cgroups`` fixture: real cgroup v2 groups (created here as root) that stand for a pod's
containers, so the enforcer sees what it sees in a pod (tests/integration/enforcer/test_containers.py,
test_tenant_attacks.py). Skipped, with the reason, where no writable cgroup2 hierarchy is available."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import time
import uuid
from collections.abc import Iterator

import pytest

from tests.support.prerequisites import missing


def _cgroup2_root() -> pathlib.Path | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                root = pathlib.Path(left.split()[4])
                if os.access(root, os.W_OK):
                    return root
    return None


class Cgroups:
    """Creates cgroups under one unique parent, moves processes into them, removes them after."""

    def __init__(self, root: pathlib.Path) -> None:
        self.parent = root / f"gpufence-test-{uuid.uuid4().hex[:12]}"
        self.parent.mkdir()
        self.made: list[pathlib.Path] = []

    def make(self, name: str) -> pathlib.Path:
        path = self.parent / name
        path.mkdir()
        self.made.append(path)
        return path

    @staticmethod
    def move(cgroup: pathlib.Path, pid: int) -> None:
        (cgroup / "cgroup.procs").write_text(str(pid))

    def cleanup(self) -> None:
        for path in self.made:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGCONT)
                    os.kill(int(pid), signal.SIGKILL)
        for path in [*self.made, self.parent]:
            deadline = time.monotonic() + 10
            while True:
                try:
                    path.rmdir()
                    break
                except OSError:
                    # Killed processes leave the cgroup once reaped: wait for that, not a fixed time.
                    assert time.monotonic() < deadline, f"cannot remove {path}"
                    time.sleep(0.01)


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    if os.geteuid() != 0:
        missing("needs root to create cgroups")
    root = _cgroup2_root()
    if root is None:
        missing("no writable cgroup2 hierarchy")
    made = Cgroups(root)
    try:
        yield made
    finally:
        made.cleanup()


