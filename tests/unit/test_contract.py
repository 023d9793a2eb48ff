"""The contract between webhook and enforcer (gpufence/contract.py) has one home.

* Neither side imports the other: the webhook and the enforcer meet only in gpufence.contract,
  which loads nothing beyond the standard library (the sidecar imports it at start).
* What the webhook writes (GPUFENCE_CONFIG) the enforcer reads back, and the enforcer refuses a
  config one step outside the schema.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufence.contract import (
    CONFIG_FIELDS,
    FIELD_CONTAINERS,
    FIELD_MODE,
    FIELD_VERSION,
    MAX_GRACE_PERIOD_SECONDS,
    MAX_POLL_INTERVAL_SECONDS,
    MIN_POLL_INTERVAL_SECONDS,
    SCHEMA_VERSION,
    SHARE_FIELDS,
    ConfigError,
    ContainerShare,
    EnforcerConfig,
    MemoryShare,
    Mode,
)
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.core.shares import SharePlan
from gpufence.webhook.core.sidecar import config_json

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gpufence"
POLICY_FILE = ROOT / "k8s" / "base" / "guard-policy.yaml"

# --- imports: the webhook and the enforcer meet only in the contract ----------------------------


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports (anywhere in it, function bodies included), absolute names."""
    return imports_of(path.read_text(), ".".join(path.relative_to(ROOT).parts[:-1]))


def imports_of(source: str, package: str) -> set[str]:
    """Every module ``source``, a module of ``package``, imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found.add(base)
            # ``from gpufence import enforcer`` imports the subpackage.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize(("side", "other"), [("webhook", "enforcer"), ("enforcer", "webhook")])
def test_neither_side_imports_the_other(side: str, other: str) -> None:
    modules = sorted((PACKAGE / side).rglob("*.py"))
    assert len(modules) > 10, f"gpufence/{side} not found"
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if _within(m, f"gpufence.{other}"))
        for path in modules
    }
    assert {path: names for path, names in offenders.items() if names} == {}, (
        f"gpufence/{side} must reach gpufence/{other} only through gpufence/contract.py"
    )


def test_the_import_check_sees_relative_and_submodule_imports() -> None:
    """The check above would pass vacuously if it missed these spellings."""
    source = "from ..enforcer import rules\nfrom . import settings\nfrom gpufence import enforcer\n" \
             "def f():\n    import gpufence.enforcer.loop\n"
    found = imports_of(source, "gpufence.webhook")
    assert {"gpufence.enforcer.rules", "gpufence.webhook.settings", "gpufence.enforcer",
            "gpufence.enforcer.loop"} <= found
    assert imported_modules(PACKAGE / "webhook" / "core" / "sidecar.py") >= {"gpufence.contract",
                                                                         "gpufence.webhook.core.shares"}


# --- GPUFENCE_CONFIG: the webhook's encoding, the enforcer's reading -----------------------------


def encode(doc: dict[str, Any]) -> str:
    """A document as the webhook's encoder writes one (compact, keys sorted)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


_percents = st.floats(min_value=0, max_value=100, exclude_min=True)
_byte_counts = st.integers(min_value=1, max_value=1 << 62)
_memory = st.one_of(st.builds(MemoryShare, bytes=_byte_counts), st.builds(MemoryShare, percent=_percents),
                    st.builds(MemoryShare, bytes=_byte_counts, percent=_percents))
_shares = st.builds(ContainerShare, memory=st.none() | _memory, compute_percent=st.none() | _percents,
                    gpus=st.none() | st.integers(min_value=1, max_value=64))
# Container names are DNS-1123 labels (the API server refuses others before admission).
_names = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", fullmatch=True)
configs = st.builds(
    EnforcerConfig,
    containers=st.dictionaries(_names, _shares, max_size=4),
    mode=st.sampled_from(Mode),
    grace_period_seconds=st.floats(min_value=0, max_value=MAX_GRACE_PERIOD_SECONDS),
    poll_interval_seconds=st.floats(min_value=MIN_POLL_INTERVAL_SECONDS, max_value=MAX_POLL_INTERVAL_SECONDS),
)

FULL = EnforcerConfig(
    containers={"train": ContainerShare(memory=MemoryShare(bytes=8 << 30, percent=25), compute_percent=50, gpus=1),
                "eval": ContainerShare(memory=MemoryShare(percent=12.5))},
    mode=Mode.AUDIT, grace_period_seconds=2.5, poll_interval_seconds=0.5,
)


@given(configs)
def test_the_enforcer_reads_back_every_config_the_webhook_encodes(config: EnforcerConfig) -> None:
    assert EnforcerConfig.from_json(config.to_json()) == config


@given(configs)
def test_the_webhook_writes_the_contract_encoding(config: EnforcerConfig) -> None:
    plan = SharePlan(containers=tuple(config.containers.items()), mode=config.mode,
                     grace_period_seconds=config.grace_period_seconds)
    settings = InjectionSettings(poll_interval_seconds=config.poll_interval_seconds)
    text = config_json(plan, settings)
    assert text == config.to_json() == encode(json.loads(text))
    written = json.loads(text)
    # Every field not at its default is written; the ones left out are at their defaults.
    assert {**config.to_dict(), **written} == config.to_dict()
    assert EnforcerConfig.from_dict({key: value for key, value in config.to_dict().items()
                                     if key in written}) == config


def _misspellings(name: str) -> list[str]:
    return [name[:-1], name[0].swapcase() + name[1:], name + "s"]


def _rename_key(doc: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    return {new if key == old else key: value for key, value in doc.items()}


def _refused_variants() -> list[tuple[str, dict[str, Any]]]:
    """Documents one step away from the webhook's encoding of FULL, each outside the schema."""
    doc = FULL.to_dict()
    variants = []
    for field in CONFIG_FIELDS:
        variants += [(f"top-level {bad!r}", _rename_key(doc, field, bad)) for bad in _misspellings(field)]
    for field in SHARE_FIELDS:
        for bad in _misspellings(field):
            containers = {**doc[FIELD_CONTAINERS], "train": _rename_key(doc[FIELD_CONTAINERS]["train"], field, bad)}
            variants.append((f"container field {bad!r}", {**doc, FIELD_CONTAINERS: containers}))
    variants.append(("unknown top-level field", {**doc, "limits": 1}))
    variants.append(("unknown container field", {**doc, FIELD_CONTAINERS: {
        **doc[FIELD_CONTAINERS], "train": {**doc[FIELD_CONTAINERS]["train"], "memoryLimit": 1}}}))
    variants.append(("unknown mode", {**doc, FIELD_MODE: "permissive"}))
    variants.append(("another version", {**doc, FIELD_VERSION: SCHEMA_VERSION + 1}))
    return variants


def test_every_field_of_the_schema_is_in_the_example() -> None:
    """So that the refusals below misspell every field of the contract."""
    doc = FULL.to_dict()
    assert set(doc) == set(CONFIG_FIELDS)
    assert set(doc[FIELD_CONTAINERS]["train"]) == set(SHARE_FIELDS)


@pytest.mark.parametrize(("what", "doc"), _refused_variants(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_enforcer_refuses_a_config_outside_the_schema(what: str, doc: dict[str, Any]) -> None:
    text = encode(doc)
    with pytest.raises(ConfigError):
        EnforcerConfig.from_json(text)


@pytest.mark.parametrize("field", CONFIG_FIELDS)
def test_a_top_level_field_left_out_is_its_default_for_the_enforcer(field: str) -> None:
    """The webhook leaves a top-level field out at its default."""
    doc = {key: value for key, value in FULL.to_dict().items() if key != field}
    assert EnforcerConfig.from_json(encode(doc)).to_dict()[field] == EnforcerConfig().to_dict()[field]


def test_the_typical_config_is_its_containers_alone() -> None:
    config = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 << 30), gpus=1)})
    assert config.to_json() == '{"containers":{"train":{"gpus":1,"memoryBytes":8589934592}}}'
