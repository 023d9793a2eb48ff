"""The contract between webhook, guard and enforcer (gpufence/contract.py) has one home.

* Neither side imports the other: the webhook and the enforcer meet only in gpufence.contract,
  which loads nothing beyond the standard library (the sidecar imports it at start).
* The guard (k8s/base/guard-policy.yaml), which cannot import Python, checks GPUFENCE_CONFIG with a
  regular expression and string searches: they are held here to the contract's schema, so that a
  field renamed, added or dropped in the contract fails this file until the guard follows.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from hypothesis import given
from hypothesis import strategies as st

from gpufence.contract import (
    CONFIG_FIELDS,
    ENFORCER_COMMAND,
    ENV_CONFIG,
    FIELD_CONTAINERS,
    FIELD_MODE,
    FIELD_VERSION,
    MAX_GRACE_PERIOD_SECONDS,
    MAX_POLL_INTERVAL_SECONDS,
    MIN_POLL_INTERVAL_SECONDS,
    MIRROR_POD_ANNOTATION,
    POST_START_COMMAND,
    PROBE_COMMAND,
    SCHEMA_VERSION,
    SHARE_FIELDS,
    SIDECAR_ENV,
    SIDECAR_NAME,
    STATUS_FIELDS,
    ConfigError,
    ContainerShare,
    EnforcerConfig,
    MemoryShare,
    Mode,
)
from gpufence.webhook.settings import InjectionSettings
from gpufence.webhook.shares import SharePlan
from gpufence.webhook.sidecar import build_sidecar, config_json, status_annotation
from tests.support.k8s_cel import FUNCTIONS as K8S_FUNCTIONS

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
    assert imported_modules(PACKAGE / "webhook" / "sidecar.py") >= {"gpufence.contract", "gpufence.webhook.shares"}


# --- the guard's GPUFENCE_CONFIG check against the schema -----------------------------------------


def _policy() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d]
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    return policy


POLICY = _policy()
VARIABLES = {v["name"]: v["expression"] for v in POLICY["spec"]["variables"]}
# All the policy's CEL: where the guard spells field names, values and variable names.
CEL = "\n".join([*VARIABLES.values(), *(v["expression"] for v in POLICY["spec"]["validations"]),
                 *(m["expression"] for m in POLICY["spec"].get("matchConditions", []))])
_ENV = celpy.Environment()
_CANONICAL = _ENV.program(_ENV.compile(VARIABLES["configIsCanonical"]), functions=K8S_FUNCTIONS)


def guard_accepts(config_text: str) -> bool:
    """The guard's ``configIsCanonical`` for a GPUFENCE_CONFIG value (it reads variables.config only)."""
    value = _CANONICAL.evaluate({"variables": celtypes.MapType({celtypes.StringType("config"):
                                                               celtypes.StringType(config_text)})})
    assert isinstance(value, celtypes.BoolType), f"configIsCanonical gave {value!r}"
    return bool(value)


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
def test_the_guard_accepts_every_config_the_webhook_encodes_and_the_enforcer_reads_it_back(
        config: EnforcerConfig) -> None:
    text = config.to_json()
    assert guard_accepts(text), text
    assert EnforcerConfig.from_json(text) == config


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
    assert guard_accepts(FULL.to_json())


@pytest.mark.parametrize(("what", "doc"), _refused_variants(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_guard_and_the_enforcer_refuse_a_config_outside_the_schema(what: str, doc: dict[str, Any]) -> None:
    text = encode(doc)
    assert not guard_accepts(text), f"the guard accepts a config with {what}: {text}"
    with pytest.raises(ConfigError):
        EnforcerConfig.from_json(text)


@pytest.mark.parametrize("field", CONFIG_FIELDS)
def test_a_top_level_field_left_out_is_its_default_for_the_guard_and_the_enforcer(field: str) -> None:
    """The webhook leaves a top-level field out at its default; only the containers are required."""
    doc = {key: value for key, value in FULL.to_dict().items() if key != field}
    if field == FIELD_CONTAINERS:
        assert not guard_accepts(encode(doc))
        return
    assert guard_accepts(encode(doc))
    assert EnforcerConfig.from_json(encode(doc)).to_dict()[field] == EnforcerConfig().to_dict()[field]


def test_the_typical_config_is_its_containers_alone() -> None:
    config = EnforcerConfig(containers={"train": ContainerShare(memory=MemoryShare(bytes=8 << 30), gpus=1)})
    assert config.to_json() == '{"containers":{"train":{"gpus":1,"memoryBytes":8589934592}}}'
    assert guard_accepts(config.to_json())


def test_the_guard_refuses_the_schema_in_another_encoding() -> None:
    """Spaces or unsorted keys would let a regular expression read other values than the enforcer's parser."""
    doc = FULL.to_dict()
    assert not guard_accepts(json.dumps(doc, sort_keys=True))
    assert not guard_accepts(json.dumps(dict(reversed(list(doc.items()))), separators=(",", ":")))


def test_every_json_key_the_guard_searches_for_is_a_field_of_the_contract() -> None:
    """``"name":`` / ``"name"`` are whole keys, ``'"prefix'`` a search for the keys it starts (a value
    after a colon, such as ``"audit"``, is checked below)."""
    keys = set(re.findall(r'(?<!:)"([A-Za-z][A-Za-z0-9]*)(?:":|"\')', CEL))
    prefixes = set(re.findall(r'(?<!:)"([A-Za-z][A-Za-z0-9]*)\'', CEL))
    contract = set(CONFIG_FIELDS) | set(SHARE_FIELDS) | set(STATUS_FIELDS)
    assert keys - contract == set(), "the guard searches for keys the contract does not have"
    assert set(CONFIG_FIELDS) | set(SHARE_FIELDS) <= keys, "a field of the contract the guard does not check"
    assert prefixes, "the guard's prefix searches were not found"
    for prefix in prefixes:
        assert [f for f in SHARE_FIELDS if f.startswith(prefix)], f"{prefix!r} matches no field of the contract"
        assert not [f for f in CONFIG_FIELDS if f.startswith(prefix)], f"{prefix!r} also matches a top-level field"


def test_every_value_the_guard_searches_for_is_one_the_contract_writes() -> None:
    allowed = {FIELD_MODE: {m.value for m in Mode}}
    searched: dict[str, set[str]] = {}
    for key, value in re.findall(r'"([A-Za-z][A-Za-z0-9]*)":"([^"]*)"', CEL):
        # A regular expression's alternatives, "(enforce|audit)", or one literal value.
        searched.setdefault(key, set()).update(value.strip("()").split("|") if value.startswith("(") else [value])
    assert searched == allowed


# --- the status annotation, the sidecar's name, command and variables ------------------------------


def test_the_guard_finds_the_sidecar_in_every_status_annotation_the_webhook_writes() -> None:
    searches = re.findall(r"injectionStatus\.contains\('([^']*)'\)", VARIABLES["hasEnforcer"])
    assert searches, "the guard's status annotation check was not found"
    share = ContainerShare(memory=MemoryShare(percent=25))
    for plan, warnings in [
        (SharePlan(containers=(("train", share),), mode=Mode.ENFORCE, grace_period_seconds=10), ()),
        (SharePlan(containers=(("a", share), ("b", share)), mode=Mode.AUDIT, grace_period_seconds=0), ["a warning"]),
    ]:
        text = status_annotation(plan, warnings)
        assert set(json.loads(text)) <= set(STATUS_FIELDS)
        for search in searches:
            assert search in text


def test_the_guard_names_the_sidecar_its_command_and_its_config_variable_as_the_contract() -> None:
    assert set(re.findall(r"c\.name == '([^']*)'", CEL)) == {SIDECAR_NAME}
    assert re.findall(r"\bc\.command == (\[[^\]]*\])", CEL) == [json.dumps([ENFORCER_COMMAND]).replace('"', "'")]
    probe, post_start = re.findall(r"exec\.command ==\s*(\[[^\]]*\])", CEL)
    assert json.loads(re.sub(r"\s+", " ", probe).replace("'", '"')) == list(PROBE_COMMAND)
    assert json.loads(re.sub(r"\s+", " ", post_start).replace("'", '"')) == list(POST_START_COMMAND)
    assert set(re.findall(r"e\.name == '(GPUFENCE_[A-Z_]*)'", CEL)) == {ENV_CONFIG}
    assert set(re.findall(r"'(gpufence\.io/[a-z.-]+|kubernetes\.io/config\.mirror)'", CEL)) <= _contract_keys()


def _contract_keys() -> set[str]:
    import gpufence.contract as contract

    return {value for name, value in vars(contract).items() if name.isupper() and isinstance(value, str) and (
        value.startswith("gpufence.io/") or value == MIRROR_POD_ANNOTATION)}


def test_the_guard_allows_the_sidecar_exactly_the_variables_the_webhook_may_set() -> None:
    allowed = re.findall(r"'(GPUFENCE_[A-Z_]+)", VARIABLES["expectedEnv"])
    assert sorted(allowed) == sorted(SIDECAR_ENV)
    plan = SharePlan(containers=(("train", ContainerShare()),), mode=Mode.ENFORCE, grace_period_seconds=10)
    # Every variable the webhook may set: a port other than the default, warnings in the status.
    sidecar = build_sidecar(plan, InjectionSettings(mount_host_proc=True, metrics_port=9402), status_warnings=True)
    assert sorted(e["name"] for e in sidecar["env"] if e["name"].startswith("GPUFENCE_")) == sorted(SIDECAR_ENV)
