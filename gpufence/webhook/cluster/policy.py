"""The cluster policy from ConfigMap ``gpufence/gpufence-policy``: the one source of every policy setting.

The ConfigMap's ``data`` keys are the webhook's policy flags without ``--`` (``max-memory``,
``allow-opt-out``, ...), its values what the flag takes; a repeatable flag's values are
comma-separated, and an absent or empty key means the flag's default, as an empty
``GPUFENCE_WEBHOOK_*`` variable does. ``parse_policy`` converts them with the flags' own converters
(webhook.flags' table), so each rule has one implementation; the protect policy reads the
same ConfigMap as its ``params`` (k8s/base/protect-policy.yaml, for ``admin-groups``).

``ClusterPolicy`` holds the InjectionSettings that new admissions use and swaps them whole when a
valid new version arrives; an invalid or missing version keeps the last valid one. ``PolicyWatch``
feeds it from a list-then-watch of that one ConfigMap (webhook.cluster.watch).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import threading
from collections.abc import Mapping
from typing import Any

from gpufence.logs import log_event
from gpufence.webhook.cluster.watch import ListWatch
from gpufence.webhook.core.settings import InjectionSettings
from gpufence.webhook.flags import POLICY_FLAGS, SERVER_FLAGS, Flag, policy_settings

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "gpufence"
DEFAULT_NAME = "gpufence-policy"

_BY_KEY: dict[str, Flag] = {f.name: f for f in POLICY_FLAGS}
_RENAMED: dict[str, str] = {f.deprecated: f.name for f in POLICY_FLAGS if f.deprecated}
_SERVER: frozenset[str] = frozenset(f.name for f in SERVER_FLAGS)
_MAX_SHOWN = 80  # characters of a value quoted back in an error


class PolicyError(ValueError):
    """The ConfigMap does not hold a valid policy; the message names each bad key, its value, the rule
    and an accepted example."""


def _shown(value: str) -> str:
    return repr(value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "...")


def _key_problem(key: str) -> str:
    if key in _RENAMED:
        return f'key "{key}" is the old name of "{_RENAMED[key]}": use "{_RENAMED[key]}"'
    if key in _SERVER:
        return (f'key "{key}" is a server flag, not policy: give it on the webhook\'s command line '
                f'(--{key}), or remove it')
    close = difflib.get_close_matches(key, list(_BY_KEY), n=1)
    hint = f'did you mean "{close[0]}"?' if close else 'e.g. "max-memory"'
    return (f'unknown key "{key}": the keys are the webhook\'s policy flags without "--" '
            f"(gpufence-webhook --help); {hint}")


def _converted(flag: Flag, text: str) -> Any:
    texts = [t.strip() for t in text.split(",")] if flag.repeat else [text]
    converted = [flag.convert(t) for t in texts]
    return tuple(converted) if flag.repeat else converted[0]


def parse_policy(data: Mapping[str, str] | None, *, source: str = f"{DEFAULT_NAMESPACE}/{DEFAULT_NAME}",
                 binary_keys: tuple[str, ...] = ()) -> InjectionSettings:
    """The InjectionSettings of a ConfigMap's ``data``; raises PolicyError listing every problem."""
    problems = [f'key "{k}" is in binaryData: the policy is read from data only' for k in binary_keys]
    values: dict[str, Any] = {}
    for key, text in sorted((data or {}).items()):
        flag = _BY_KEY.get(key)
        if flag is None:
            problems.append(_key_problem(key))
            continue
        if not isinstance(text, str):
            problems.append(f'key "{key}" is not a string; e.g. {key}: "{flag.example_value}"')
            continue
        if text == "":
            continue  # the flag's default, as an empty GPUFENCE_WEBHOOK_* variable
        try:
            values[flag.dest] = _converted(flag, text)
        except ValueError as exc:
            repeat = " (comma-separated)" if flag.repeat else ""
            problems.append(f'key "{key}" has {_shown(text)}{repeat}: {exc}; e.g. {key}: "{flag.example_value}"')
    if problems:
        raise PolicyError(f"ConfigMap {source}: " + "; ".join(problems))
    return policy_settings(values)


def changed_fields(old: InjectionSettings | None, new: InjectionSettings) -> list[str]:
    """The InjectionSettings fields that differ (all of them where there was none before)."""
    return [f.name for f in dataclasses.fields(InjectionSettings)
            if old is None or getattr(old, f.name) != getattr(new, f.name)]


class ClusterPolicy:
    """The InjectionSettings new admissions use: fixed (flags), or the last valid ConfigMap version.

    ``current`` is one attribute read, replaced whole by the watch thread, so a review sees one
    consistent policy without a lock on the admission path.
    """

    def __init__(self, settings: InjectionSettings | None = None, *, source: str | None = None) -> None:
        self.current: InjectionSettings | None = settings
        self.source = source  # NAMESPACE/NAME of the ConfigMap, or None for the flags
        self.valid = settings is not None  # the last version seen (or the flags) is in use
        self.problem: str | None = None if settings is not None else f"ConfigMap {source} has not been read yet"
        self.applied_version: str | None = None  # resourceVersion of the ConfigMap in use
        self.successes = 0
        self.failures = 0
        self._lock = threading.Lock()  # one writer at a time; readers only read ``current``

    def not_ready_reason(self) -> str | None:
        """Why no admission can be answered yet (no valid policy ever loaded), or None."""
        if self.current is not None:
            return None
        return f"no valid cluster policy yet: {self.problem}"

    def offer(self, configmap: Mapping[str, Any] | None) -> bool:
        """A version of the ConfigMap as the API server has it (None: it does not exist); True if applied."""
        with self._lock:
            if configmap is None:
                return self._reject(f"ConfigMap {self.source} does not exist", None, event="policy_missing")
            meta = configmap.get("metadata") or {}
            version = str(meta.get("resourceVersion") or "")
            try:
                settings = parse_policy(configmap.get("data"), source=str(self.source),
                                        binary_keys=tuple(sorted(configmap.get("binaryData") or {})))
            except PolicyError as exc:
                return self._reject(str(exc), version, event="policy_invalid")
            changed = changed_fields(self.current, settings)
            news = bool(changed) or not self.valid  # a relist of the version in use is no news
            self.current, self.valid, self.problem, self.applied_version = settings, True, None, version
            if news:
                self.successes += 1
                log_event(log, "policy_loaded", configmap=self.source, resource_version=version, changed=changed)
            return True

    def unreadable(self, error: str) -> None:
        """The ConfigMap could not be read (the watch retries); the reason, while there is no policy yet."""
        with self._lock:
            if self.current is None:
                self.problem = f"cannot read ConfigMap {self.source}: {error[:300]}"

    def _reject(self, problem: str, version: str | None, *, event: str) -> bool:
        self.valid, self.problem = False, problem
        self.failures += 1
        keeping = (f"keeping the last valid version (resourceVersion {self.applied_version})"
                   if self.current is not None else "no valid version yet: /readyz fails")
        log_event(log, event, logging.ERROR, configmap=self.source, resource_version=version, error=problem,
                  message=f"{problem}; {keeping}")
        return False


class PolicyWatch(ListWatch):
    """Feeds a ``ClusterPolicy`` from a list-then-watch of one ConfigMap.

    List and watch select the object by ``fieldSelector=metadata.name=NAME``: the API server then
    authorises them against a Role's ``resourceNames``, so the webhook may read this ConfigMap only.
    """

    what = "policy"

    def __init__(self, api: Any, namespace: str, name: str, policy: ClusterPolicy, **options: Any) -> None:
        # api: kubernetes.client.CoreV1Api
        list_call = functools.partial(api.list_namespaced_config_map, namespace,
                                      field_selector=f"metadata.name={name}")
        super().__init__(list_call, **options)
        self.policy = policy

    def _replace(self, items: list[Mapping[str, Any]]) -> None:
        self.policy.offer(items[0] if items else None)

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        self.policy.offer(None if kind == "DELETED" else obj)

    def _failed(self, error: Exception) -> None:
        # Before a first version, /readyz says why none came (a 403 means the Role is missing).
        self.policy.unreadable(f"{type(error).__name__}: {error}".strip())
