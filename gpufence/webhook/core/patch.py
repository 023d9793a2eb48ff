"""RFC 6902 JSON Patch between the submitted pod and the desired pod (pure), and the JSON bytes of
the AdmissionReview in and out.

Why our own diff rather than ``jsonpatch.make_patch``: both give correct patches, but
* ``make_patch`` compares values by equality, so it walks every subtree of the pod (milliseconds
  for a 1 MiB pod); ``diff`` follows the desired pod only where it is not the *same object* as the
  input (``desired_pod`` is copy-on-write), so its cost is the size of what changed;
* ``make_patch`` aligns lists by value and may express a change as ``move`` / ``copy`` or as a
  replacement of a whole entry. A patch for Kubernetes lists (containers, env, volumes) should be
  list-index-safe against what it was computed from and never touch another container's entries:
  ``diff`` aligns lists of uniquely named objects by ``name`` (removals from the end first, then
  insertions and in-place updates in the new order), and otherwise by position, and emits only
  ``add`` / ``remove`` / ``replace``. For the shapes ``desired_pod`` makes (a sidecar inserted at
  ``initContainers[0]``, env entries appended, fields added) it is minimal: one ``add`` per new
  value, nothing for a fixed point. tests/unit/webhook/test_patch.py checks it on arbitrary JSON against
  ``jsonpatch.apply_patch``.

JSON on the wire: orjson for the AdmissionReview in and out, the stdlib where orjson refuses.

orjson decodes and encodes the review several times faster than the stdlib (measured when it came
in: CHANGELOG.md), which is most of what a review costs besides the review itself. Its few
refusals are all on input the API server never sends and that we answer with a 400 anyway: NaN
and Infinity, invalid UTF-8 or lone surrogates, nesting deeper than 1024. It reads integers beyond
64 bits as floats, which the shape check then refuses where the injection reads them. On encoding
it refuses what the stdlib still writes (integers beyond 64 bits, nesting beyond 254 levels, keys
that are not strings): those values can only come from a caller that built the pod in Python, and
the stdlib writes them, with the same compact separators.
"""

from __future__ import annotations

import json
from operator import is_
from typing import Any

import orjson

_MISSING = object()

_stdlib_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def loads(data: bytes | str) -> Any:
    """The JSON value of ``data``; raises ``orjson.JSONDecodeError`` (a ValueError) with a position."""
    return orjson.loads(data)


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value``."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return _stdlib_compact(value).encode()


def canonical(value: Any) -> bytes | None:
    """JSON of ``value`` with sorted keys: equal bytes for equal JSON values, of equal JSON types
    (``true`` is not ``1``, ``1.0`` is not ``1``, where Python's ``==`` says they are). None where
    orjson refuses the value (see above): no canonical form, and callers take the long way."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        return None


def escape(token: str) -> str:
    """An RFC 6901 reference token."""
    if "~" in token or "/" in token:
        return token.replace("~", "~0").replace("/", "~1")
    return token


def diff(old: Any, new: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations turning ``old`` into ``new``.

    Recursion follows ``new`` only where it differs from ``old`` (shared subtrees are skipped by
    identity), so its depth is bounded by the webhook's own objects, not by the user's.
    """
    if _same(old, new):
        # The fixed point (a reinvocation, /validate of the pod gpufence admitted): the desired pod
        # copies every subtree the review rewrites, so the walk below would visit each of them to
        # find nothing. Several times cheaper in C.
        return []
    ops: list[dict[str, Any]] = []
    _diff(old, new, path, ops)
    return ops


def _same(old: Any, new: Any) -> bool:
    """Whether ``diff(old, new)`` is empty: equal, and of the same JSON types (``==`` alone takes
    ``True`` for ``1``, where the diff replaces it). False where it cannot tell cheaply."""
    try:
        if old != new:  # different pods usually differ early: a few microseconds
            return False
    except RecursionError:  # ``==`` follows the user's nesting, which the walk below need not
        return False
    a = canonical(old)
    return a is not None and a == canonical(new)


def _diff(old: Any, new: Any, path: str, ops: list[dict[str, Any]]) -> None:
    if old is new:
        return
    if isinstance(old, dict) and isinstance(new, dict):
        for key in old:
            if key not in new:
                ops.append({"op": "remove", "path": f"{path}/{escape(key)}"})
        get = old.get
        for key, value in new.items():
            previous = get(key, _MISSING)
            if previous is value:
                continue  # shared with the input (the common case): nothing below can differ
            if previous is _MISSING:
                ops.append({"op": "add", "path": f"{path}/{escape(key)}", "value": value})
            else:
                _diff(previous, value, f"{path}/{escape(key)}", ops)
        return
    if isinstance(old, list) and isinstance(new, list):
        _diff_list(old, new, path, ops)
        return
    if type(old) is not type(new) or old != new:
        ops.append({"op": "replace", "path": path, "value": new})


def _names(items: list[Any]) -> list[str] | None:
    """The entries' names when every entry is an object with a unique string name, else None."""
    names = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        names.append(item["name"])
    return names if len(set(names)) == len(names) else None


def _diff_list(old: list[Any], new: list[Any], path: str, ops: list[dict[str, Any]]) -> None:
    n = len(old)
    if len(new) >= n and all(map(is_, old, new)):
        # Appended to (a GPU container's env, the pod's volumes): the named and the positional
        # alignments below both reduce to adding the tail.
        for i in range(n, len(new)):
            ops.append({"op": "add", "path": f"{path}/{i}", "value": new[i]})
        return
    old_names, new_names = _names(old), _names(new)
    if old_names is not None and new_names is not None:
        # Align named entries (containers, env, volumes) when the kept ones keep their order:
        # removals (from the end, so earlier indices stay valid), then insertions and updates.
        new_set, old_set = set(new_names), set(old_names)
        kept = [name for name in old_names if name in new_set]
        if kept == [name for name in new_names if name in old_set]:
            for i in range(len(old) - 1, -1, -1):
                if old_names[i] not in new_set:
                    ops.append({"op": "remove", "path": f"{path}/{i}"})
            by_name = dict(zip(old_names, old, strict=True))
            for i, (name, item) in enumerate(zip(new_names, new, strict=True)):
                if name in old_set:
                    _diff(by_name[name], item, f"{path}/{i}", ops)
                else:
                    ops.append({"op": "add", "path": f"{path}/{i}", "value": item})
            return
    # Positional: update the common part in place, then append or trim the tail.
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        _diff(a, b, f"{path}/{i}", ops)
    for i in range(len(old), len(new)):
        ops.append({"op": "add", "path": f"{path}/{i}", "value": new[i]})
    for i in range(len(old) - 1, len(new) - 1, -1):
        ops.append({"op": "remove", "path": f"{path}/{i}"})
