"""How many bytes the injection adds to a pod, over the goldens (tests/golden).

For each case the webhook mutates (outcome ``mutated``): the length of the output pod minus the
input pod, both as compact JSON (UTF-8), as the webhook's patch leaves it and before the API
server's defaults and managed fields. Shared by bench/injected_bytes.py (the figure) and
tests/unit/webhook/test_injected_bytes.py (the gate).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
# libyaml's parser where PyYAML has it (the same documents, about ten times faster than pure Python).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_LOADER)


def compact_size(obj: Any) -> int:
    return len(json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode())


def bytes_added(golden: Path = GOLDEN) -> dict[str, int]:
    """Case name -> bytes the injection adds, for every mutated case."""
    added: dict[str, int] = {}
    for out_file in sorted(golden.glob("*.out.yaml")):
        out = load_yaml(out_file)
        if out.get("outcome") != "mutated":
            continue
        case = out_file.name.removesuffix(".out.yaml")
        before = load_yaml(golden / f"{case}.in.yaml")["pod"]
        added[case] = compact_size(out["pod"]) - compact_size(before)
    return added
