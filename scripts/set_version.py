"""Set gpufence's version everywhere it is written: ``python -m scripts.set_version 0.2.0``.

gpufence/__init__.py is the source; the Python side (package metadata, ``--version``, the default
sidecar image) reads it. Manifests cannot import it, so the kustomize files, the Helm chart and
the install docs repeat it; SITES lists every such place. tests/deploy/test_version.py checks that all of
them agree with the source, so a release that forgets one fails the suite instead of shipping a
webhook that injects another version's sidecar.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION_RE = r"[0-9]+\.[0-9]+\.[0-9]+(?:-[0-9A-Za-z.-]+)?"
_VERSION_FULL = re.compile(VERSION_RE)


@dataclass(frozen=True)
class Site:
    """Files (a glob under the repository root) holding the version inside ``pattern``'s group 1."""

    glob: str
    pattern: re.Pattern[str]

    def files(self, root: Path) -> list[Path]:
        return sorted(root.glob(self.glob))


def _site(glob: str, before: str, after: str = "") -> Site:
    return Site(glob, re.compile(f"(?<={before})({VERSION_RE})(?={after})", re.MULTILINE))


SITES: tuple[Site, ...] = (
    _site("gpufence/__init__.py", r'^__version__ = "', '"'),
    # The app.kubernetes.io/version label and the image tag of every kustomization.
    _site("k8s/**/kustomization.yaml", r'app\.kubernetes\.io/version: "', '"'),
    _site("k8s/base/kustomization.yaml", r'newTag: "', '"'),
    # Image references as written (kustomize's images: rewrites them, but --sidecar-image is an arg).
    _site("k8s/base/*.yaml", r"ghcr\.io/gpufence/gpufence:"),
    _site("k8s/components/node-guardian/daemonset.yaml", r"ghcr\.io/gpufence/gpufence:"),
    # The Helm chart: its own version and the app's (the default image tag).
    _site("charts/gpufence/Chart.yaml", r"^version: "),
    _site("charts/gpufence/Chart.yaml", r'^appVersion: "', '"'),
    # The remote kustomize example pins a release tag.
    _site("docs/install.md", r"\?ref=v"),
    _site("docs/monitoring.md", r"\?ref=v"),  # its kustomization example
    # docs/install.md's example of pointing the install at your image.
    _site("docs/install.md", r"/gpufence:"),
    _site("docs/install.md", r'newTag: "', '"'),
    # The webhook's expected output names the default sidecar image, which carries the version.
    _site("tests/golden/*.yaml", r"ghcr\.io/gpufence/gpufence:"),
)


def found(root: Path = ROOT) -> dict[str, set[str]]:
    """``path (pattern)`` -> the versions written there (empty set: the site matched nothing)."""
    result: dict[str, set[str]] = {}
    for site in SITES:
        files = site.files(root)
        if not files:
            result[f"{site.glob} (no file)"] = set()
        for path in files:
            versions = set(site.pattern.findall(path.read_text()))
            # A glob such as k8s/base/*.yaml also matches files that do not name the image.
            if versions or "*" not in site.glob:
                result[f"{path.relative_to(root)} ({site.pattern.pattern})"] = versions
    return result


def rewrite(new: str, root: Path = ROOT) -> list[Path]:
    """Write ``new`` into every site; returns the files changed."""
    if not _VERSION_FULL.fullmatch(new):
        raise ValueError(f"not a version: {new!r} (expected MAJOR.MINOR.PATCH[-PRERELEASE])")
    changed: list[Path] = []
    for site in SITES:
        for path in site.files(root):
            text = path.read_text()
            updated = site.pattern.sub(new, text)
            if updated != text:
                path.write_text(updated)
                if path not in changed:
                    changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.set_version", description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the new version, e.g. 0.2.0")
    args = parser.parse_args(argv)
    try:
        changed = rewrite(args.version)
    except ValueError as exc:
        parser.error(str(exc))
    for path in changed:
        print(path.relative_to(ROOT))
    print("Reinstall (make venv) so the installed package metadata follows.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
