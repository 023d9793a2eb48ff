"""docs/install.md's examples do what they say: the kustomization that points the install at your
own image renders with that image everywhere, the sidecar's included; the install starts with
building the image."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from gpufence import __version__
from tests.support.prerequisites import needs

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "docs" / "install.md"


def section(title: str) -> str:
    text = INSTALL.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def test_install_starts_with_building_the_image() -> None:
    headings = re.findall(r"^## (.+)$", INSTALL.read_text(), re.MULTILINE)
    assert headings[:2] == ["Build and push the image", "Point the install at your image"]
    assert "docker build" in section("Build and push the image")


@needs(shutil.which("kubectl") is not None, reason="kubectl not installed: cannot render kustomizations")
def test_image_kustomization_example_renders_the_new_image_everywhere(tmp_path: Path) -> None:
    (block,) = re.findall(r"```yaml\n(.*?)```", section("Point the install at your image"), re.DOTALL)
    kustomization = yaml.safe_load(block)
    assert kustomization["resources"][0].startswith("https://github.com/gpufence/gpufence//k8s?ref=v")
    # The same kustomization over this checkout instead of the release on GitHub.
    kustomization["resources"] = [os.path.relpath(ROOT / "k8s", tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr
    objects = [o for o in yaml.safe_load_all(result.stdout) if o]
    wanted = f"registry.example.com/platform/gpufence:{__version__}"
    images = set(re.findall(r"image: (\S+)", result.stdout))
    assert images == {wanted}
    # The sidecar image the webhook injects comes from the policy ConfigMap.
    (policy,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpufence-policy"]
    assert policy["data"]["sidecar-image"] == wanted


def test_the_image_build_blocks_name_what_the_checkout_has() -> None:
    """The build blocks need a Docker engine (tests/e2e/test_install_commands.py leaves them out, marked):
    their version line runs here, and every ``--target`` they build is a stage of the Dockerfile."""
    blocks = re.findall(r"```sh\n(.*?)```", section("Build and push the image"), re.DOTALL)
    script = "\n".join(blocks)
    (version_line,) = [line for line in script.splitlines() if line.startswith("VERSION=")]
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", f"{version_line.split('#')[0]}\necho \"$VERSION\""],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == __version__, result.stdout + result.stderr
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))
    targets = set(re.findall(r"--target (\S+)", script))
    assert targets and targets <= stages, f"--target {targets - stages} is no stage of the Dockerfile ({stages})"
    assert re.search(r"^docker build -t \"\$IMAGE\" \.", script, re.MULTILINE), "the default build is the last stage"
