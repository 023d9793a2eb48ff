"""The one place gpufence's version is written.

The package version (pyproject.toml reads ``__version__`` at build time), the image tag the
webhook puts on the sidecar by default, and ``--version`` of gpufence-webhook, gpufence-enforcer
and gpufence-certs all come from here. Manifests cannot import Python, so the kustomize files and
the Helm chart repeat the version literally; ``python -m scripts.set_version NEW`` rewrites every
copy and tests/deploy/test_version.py fails when one differs.
"""

__version__ = "0.1.0"

IMAGE_REPOSITORY = "ghcr.io/gpufence/gpufence"
# The image built from this tree (docs/install.md, "Build and push the image").
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints."""
    return f"{prog} {__version__}"
