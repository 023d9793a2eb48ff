"""Pods whose fields have the wrong JSON type (issue 38, row 4): a list or an object where a
string, number or boolean belongs, and the reverse.

The bases are the golden cases' input pods (tests/golden/*.in.yaml): together they hold every
field the webhook's rules read (env, mounts, volumes, security contexts, resources, claims,
affinity, KAI's annotations...), so swapping the type of a place in one reaches each rule with a
type it did not expect. Shared by the unit property test and the fuzz over HTTPS.
"""

from __future__ import annotations

import copy
import random
from functools import cache
from pathlib import Path
from typing import Any

import yaml

GOLDEN = Path(__file__).parents[1] / "golden"
Place = tuple[Any, ...]


@cache
def golden_pods() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(case, input pod) of every golden case, in name order."""
    return tuple((p.name.removesuffix(".in.yaml"), yaml.safe_load(p.read_text())["pod"])
                 for p in sorted(GOLDEN.glob("*.in.yaml")))


def places(value: Any, at: Place = ()) -> list[Place]:
    """Every place in ``value`` (the root excluded): objects' values and lists' items alike."""
    found: list[Place] = [at] if at else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += places(item, (*at, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += places(item, (*at, i))
    return found


def swaps(value: Any) -> list[Any]:
    """Values of another JSON type than ``value``: a scalar becomes a list or an object (holding it,
    or empty) or another scalar; an object or a list becomes a scalar or the other container."""
    if isinstance(value, dict):
        return [[value], "x", 1, True, None, [], [{"name": "x"}]]
    if isinstance(value, list):
        return [{"k": value}, "x", 0, False, None, {}]
    held = value if isinstance(value, str) else "x"
    return [[held], {"k": held}, [], {}, *(v for v in ("1", 1, 1.5, True, None) if type(v) is not type(value))]


def get(doc: Any, at: Place) -> Any:
    for step in at:
        doc = doc[step]
    return doc


def put(doc: Any, at: Place, value: Any) -> None:
    get(doc, at[:-1])[at[-1]] = value


def swapped(pod: dict[str, Any], choose: Any, count: int) -> dict[str, Any]:
    """A copy of ``pod`` with ``count`` places swapped; ``choose(options)`` picks one of a list
    (``random.Random.choice``, or hypothesis' ``draw`` of ``sampled_from``)."""
    pod = copy.deepcopy(pod)
    for _ in range(count):
        options = places(pod)
        if not options:
            break
        at = choose(options)
        put(pod, at, choose(swaps(get(pod, at))))
    return pod


def random_swapped_pods(count: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``count`` (case, pod) pairs, each a golden pod with one to three places swapped."""
    rng = random.Random(seed)
    pods = golden_pods()
    out = []
    for _ in range(count):
        case, pod = rng.choice(pods)
        out.append((case, swapped(pod, rng.choice, rng.randint(1, 3))))
    return out
