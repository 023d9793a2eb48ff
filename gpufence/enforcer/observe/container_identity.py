"""Which container a process belongs to: the cgroup is the identity, claims only name cgroups (pure).

In a pod every container is its own cgroup, which a process cannot leave; ``GPUFENCE_CONTAINER`` in
a process's environment is a claim any process can make, drop (``env -i``, ``sudo``) or lose
(setproctitle overwrites the environ block). The functions here turn the claims seen per cgroup,
and the names bound to cgroups on earlier ticks, into one name (or None) per cgroup.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from gpufence.enforcer.observe.procfs import ProcFacts

__all__ = ["assign", "bind_names", "cgroup_names", "claims_by_cgroup", "informative", "resolve_containers"]


def resolve_containers(
    facts: Iterable[ProcFacts], own_cgroup: str | None, bound: Mapping[str, str] | None = None
) -> dict[int, str | None]:
    """Each process's container (pid -> name or None): the cgroup is the identity, the
    ``GPUFENCE_CONTAINER`` claims only name cgroups.

    In a pod every container is its own cgroup, which a process cannot leave; the environment
    variable is a claim any process can make (or lose: ``env -i``, ``sudo``, setproctitle). So:

    * a cgroup whose claimants all name one container is that container, and so is every process
      in it, a process without a readable claim included;
    * a cgroup with no claimant this tick is the container ``bound`` to it (a name it carried
      before, see :func:`bind_names`), else unattributed;
    * a cgroup whose processes claim different names is unattributed as a whole (it then falls
      under the pod budget) and does not disturb any other cgroup;
    * one name claimed by several cgroups: the cgroup ``bound`` to that name keeps it, the others
      are unattributed; with no binding (the spoof predates the enforcer) all of them are;
    * a cgroup that is unreadable or equal to the enforcer's own says nothing (tests, the demo and
      ``--simulate`` run every workload in one cgroup): each claim is taken as is.
    """
    facts = list(facts)
    names = cgroup_names(claims_by_cgroup(facts, own_cgroup), bound or {})
    return assign(facts, own_cgroup, names)


def assign(
    facts: Iterable[ProcFacts], own_cgroup: str | None, names: Mapping[str, str | None]
) -> dict[int, str | None]:
    """pid -> container: its cgroup's name where the cgroup is informative, else its own claim."""
    resolved: dict[int, str | None] = {}
    for f in facts:
        if f.cgroup is not None and informative(f.cgroup, own_cgroup):
            resolved[f.pid] = names.get(f.cgroup)
        else:
            resolved[f.pid] = f.container
    return resolved


def claims_by_cgroup(facts: Iterable[ProcFacts], own_cgroup: str | None) -> dict[str, set[str]]:
    """informative cgroup -> the names its processes claim (an empty set: nobody claims)."""
    claims: dict[str, set[str]] = defaultdict(set)
    for f in facts:
        if informative(f.cgroup, own_cgroup):
            assert f.cgroup is not None
            entry = claims[f.cgroup]
            if f.container is not None:
                entry.add(f.container)
    return claims


def cgroup_names(claims: Mapping[str, set[str]], bound: Mapping[str, str]) -> dict[str, str | None]:
    """informative cgroup -> its container name or None (the rules of :func:`resolve_containers`)."""
    by_cgroup = {value: name for name, value in bound.items()}
    candidate: dict[str, str | None] = {}
    for cgroup, names in claims.items():
        if len(names) == 1:
            candidate[cgroup] = next(iter(names))
        elif not names:
            candidate[cgroup] = by_cgroup.get(cgroup)
        else:
            candidate[cgroup] = None  # conflicting claims: the whole cgroup is unattributed
    cgroups_by_name: dict[str, set[str]] = defaultdict(set)
    for cgroup, name in candidate.items():
        if name is not None:
            cgroups_by_name[name].add(cgroup)
    result: dict[str, str | None] = {}
    for cgroup, name in candidate.items():
        if name is not None and len(cgroups_by_name[name]) > 1 and bound.get(name) != cgroup:
            name = None  # another cgroup holds this name (or nobody can tell which one does)
        result[cgroup] = name
    return result


def bind_names(names: Mapping[str, str | None], bound: Mapping[str, str]) -> dict[str, str]:
    """The bindings name -> cgroup after a tick: a name held by exactly one cgroup is bound to it
    (a restarted container gets a new cgroup and takes its name with it); a binding whose name no
    cgroup holds this tick is kept, so a later impostor cannot take over an idle container's name."""
    holders: dict[str, list[str]] = defaultdict(list)
    for cgroup, name in names.items():
        if name is not None:
            holders[name].append(cgroup)
    result = dict(bound)
    for name, cgroups in holders.items():
        if len(cgroups) == 1:
            result[name] = cgroups[0]
    return result


def informative(cgroup: str | None, own_cgroup: str | None) -> bool:
    return cgroup is not None and cgroup != own_cgroup
