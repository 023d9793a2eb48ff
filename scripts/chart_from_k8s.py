"""Write the Helm chart's copies of k8s/ content: ``python -m scripts.chart_from_k8s [--check]``.

The chart (charts/gpufence) has its own templates, but three pieces of the kustomize install are
content rather than structure, and are kept in one place, k8s/: the protect policy's CEL
(k8s/base/protect-policy.yaml), the alert rules' PromQL
(k8s/components/monitoring/prometheusrule.yaml) and the Grafana dashboard
(k8s/components/monitoring/dashboards/gpufence.json). Helm cannot read files outside the chart, and
kustomize cannot read files outside its kustomization, so this script copies them into the chart:
the two YAML files become templates, changed only where Helm needs it
(their labels come from the chart's gpufence.labels helper; a ``{{ ... }}`` of Prometheus'
templates is escaped so Helm writes it as is; the monitoring objects render only with
monitoring.enabled), and the dashboard is copied byte for byte.

Edit k8s/, then run this; ``--check`` (tests/deploy/test_chart_drift.py) exits 1 naming the copies that
are stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHART = Path("charts/gpufence")
LABEL_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/component")


class ChartSourceError(ValueError):
    """A k8s/ file the script cannot turn into a chart template; the message says where and why."""


@dataclass(frozen=True)
class Copy:
    source: Path  # relative to the repository root
    target: Path
    template: bool  # a chart template (else a file copied byte for byte)
    condition: str = ""  # a Helm condition the whole template renders under
    extra_labels: str = ""  # a values path added to every object's labels

    def render(self, root: Path) -> str:
        text = (root / self.source).read_text()
        return template_of(text, self) if self.template else text


COPIES: tuple[Copy, ...] = (
    Copy(Path("k8s/base/protect-policy.yaml"), CHART / "templates/protect/protect-policy.yaml", template=True),
    Copy(Path("k8s/components/monitoring/prometheusrule.yaml"), CHART / "templates/monitoring/prometheusrule.yaml",
         template=True, condition=".Values.monitoring.enabled", extra_labels="$.Values.monitoring.labels"),
    Copy(Path("k8s/components/monitoring/dashboards/gpufence.json"), CHART / "files/gpufence.json", template=False),
)

_METADATA = re.compile(r"^metadata:\n((?:[ ]{2}.*\n|\n)+)", re.MULTILINE)
_LABELS = re.compile(r"^([ ]{2}labels:\n)((?:[ ]{4}.*\n)+)", re.MULTILINE)
_LABEL_LINE = re.compile(r"[ ]{4}(?P<key>[A-Za-z0-9./_-]+):[ ]+(?P<value>[A-Za-z0-9._-]+)\n")
_NAME = re.compile(r"^[ ]{2}name:[ ]+(\S+)$", re.MULTILINE)
_GO_TEMPLATE = re.compile(r"\{\{(.*?)\}\}")


def _labels_include(source: Path, document: str, extra_labels: str) -> str:
    """``document`` with its metadata.labels replaced by an include of gpufence.labels."""
    metadata = _METADATA.search(document)
    if metadata is None:
        return document  # a comment-only document
    name = _NAME.search(metadata.group(1))
    where = f"{source}: object {name.group(1) if name else '(unnamed)'}"
    labels = _LABELS.search(metadata.group(1))
    values = dict(_LABEL_LINE.findall(labels.group(2))) if labels else {}
    every_line_a_label = labels is not None and len(values) == labels.group(2).count("\n")
    if not every_line_a_label or sorted(values) != sorted(LABEL_KEYS):
        found = labels.group(2).strip() if labels else "none"
        raise ChartSourceError(
            f"{where}: its metadata.labels are {found!r}; the chart's copy takes exactly "
            f"{' and '.join(LABEL_KEYS)} (the chart adds part-of, version and Helm's labels), e.g.\n"
            "  labels:\n    app.kubernetes.io/name: gpufence-protect\n    app.kubernetes.io/component: protect")
    call = (f'(dict "context" $ "name" "{values[LABEL_KEYS[0]]}" "component" "{values[LABEL_KEYS[1]]}"'
            + (f' "extra" {extra_labels}' if extra_labels else "") + ")")
    include = f'    {{{{- include "gpufence.labels" {call} | nindent 4 }}}}\n'
    block = metadata.group(1)
    new_block = block[:labels.start()] + labels.group(1) + include + block[labels.end():]
    return document[:metadata.start(1)] + new_block + document[metadata.end(1):]


def _escape_go_templates(source: Path, text: str) -> str:
    """Each ``{{ ... }}`` (Prometheus' alert templates) as a Helm raw string, so Helm writes it as is."""
    lines = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        escaped = _GO_TEMPLATE.sub(lambda m: "{{`" + m.group(0) + "`}}", line)
        if "`" in "".join(_GO_TEMPLATE.findall(line)) or _GO_TEMPLATE.sub("", line).count("{{"):
            raise ChartSourceError(
                f"{source}:{number}: {line.strip()!r}: a '{{{{' the chart cannot copy: each must close with '}}}}' "
                "on the same line and hold no backtick, e.g. {{ $labels.namespace }}")
        lines.append(escaped)
    return "".join(lines)


def template_of(text: str, copy: Copy) -> str:
    documents = re.split(r"(?m)^(?=---[ \t]*$)", _escape_go_templates(copy.source, text))
    body = "".join(_labels_include(copy.source, d, copy.extra_labels) for d in documents)
    changes = ["its labels come from gpufence.labels (_helpers.tpl)"]
    if "{{`" in body:
        changes.append("Prometheus' templates are escaped")
    if copy.condition:
        changes.append(f"it renders only if {copy.condition.removeprefix('.Values.')}")
    note = (f"Generated from {copy.source} by `python -m scripts.chart_from_k8s`: edit that file and rerun "
            f"(tests/deploy/test_chart_drift.py fails while this copy is stale). Changed only where Helm needs it: "
            f"{'; '.join(changes)}.")
    header = "{{- /*\n" + textwrap.fill(note, width=100) + "\n*/ -}}\n"
    if copy.condition:
        return f"{header}{{{{- if {copy.condition} }}}}\n{body}{{{{- end }}}}\n"
    return header + body


def stale(root: Path = ROOT) -> list[Path]:
    """The copies whose file differs from what their source gives."""
    return [c.target for c in COPIES if not (root / c.target).is_file() or (root / c.target).read_text() != c.render(
        root)]


def write(root: Path = ROOT) -> list[Path]:
    changed = stale(root)
    for copy in COPIES:
        if copy.target in changed:
            (root / copy.target).parent.mkdir(parents=True, exist_ok=True)
            (root / copy.target).write_text(copy.render(root))
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.chart_from_k8s", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a copy is stale")
    args = parser.parse_args(argv)
    try:
        changed = stale() if args.check else write()
    except ChartSourceError as exc:
        print(f"chart_from_k8s: {exc}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"{'stale' if args.check else 'wrote'}: {path}")
    if args.check and changed:
        print("Run `python -m scripts.chart_from_k8s` to update the chart's copies.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
