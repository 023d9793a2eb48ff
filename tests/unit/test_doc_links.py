"""Every relative link in the README and docs/ names a file that exists: moving a document (docs/
is split by audience, docs/internals/ for developers) must break the suite, not a reader's click."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_that_exist(document: Path) -> None:
    missing = [
        target for target in LINK.findall(document.read_text())
        if not target.startswith(("http://", "https://", "mailto:")) and not (document.parent / target).exists()
    ]
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"
