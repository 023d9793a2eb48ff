"""Which of the guard's validations cost the API server most, per pod it admits.

    python -m bench.guard_validations [--version v1.37.2] [--pods 150] [--rounds 2] [--variables]

One control plane with gpufence installed as shipped (bench.pod_creation's setup), the webhook
switched off for one opted-in namespace, and the pod as gpufence stores it created there one at a
time, so that only the ``gpufence-guard`` policy's CEL runs. Between runs the policy is replaced by
variants that keep the shipped variables and ``matchConditions`` but only some validations: none
(one ``true`` expression), each validation alone, and all of them (as shipped). Variables are
evaluated lazily, once per request, so a validation alone costs what it and the variables it reads
cost. The figure is the API server's own time in its ValidatingAdmissionPolicy plugin per create
(``apiserver_admission_controller_admission_duration_seconds``), median over rounds, variants
rotated round by round. With ``--variables``, each variant instead keeps one validation that reads
one variable (``size([variables.X]) == 1``), so its figure is that variable's cost with the
variables it reads, to find where the cost of a validation lies. The installed policy is put back
as shipped at the end; the shipped file is never changed: this bench measures, it does not alter
what the guard enforces.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import table, write_section
from bench.pod_creation import (
    GUARD,
    SWITCH_PREFIX,
    add_switches,
    bench_pod,
    create_many,
    policy_plugin_time,
    pre_injected_pod,
)
from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS, control_plane
from tests.e2e.controlplane import ControlPlane, running_control_plane
from tests.e2e.gpufence_install import apply_objects, start_gpufence
from tests.support.stats import median

WARMUP = 20


def variants(validations: list[dict[str, Any]], variables: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    nothing = [{"expression": "true", "message": "bench: no validation"}]
    out = {"none (variables unused)": nothing}
    if variables is not None:
        for name in variables:
            out[f"variable {name}"] = [{"expression": f"size([variables.{name}]) == 1", "message": "bench"}]
        return out
    for i, v in enumerate(validations, 1):
        out[f"{i}: {v['expression'].strip()[:70]}"] = [v]
    out["all (as shipped)"] = validations
    return out


def install_variant(cp: ControlPlane, shipped: dict[str, Any], validations: list[dict[str, Any]]) -> None:
    policy = copy.deepcopy(shipped)
    policy["spec"]["validations"] = validations
    for key in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        policy["metadata"].pop(key, None)
    policy.pop("status", None)
    apply_objects(cp, [policy], "--force-conflicts")
    # The API server compiles the policy from its own watch; the type checker's observedGeneration
    # says it has seen this generation, and the warm-up creates are outside the measurement.
    kube.wait_for(lambda: _observed(cp), "the policy variant to be observed", timeout=30)


def _observed(cp: ControlPlane) -> bool:
    p = json.loads(cp.kubectl("get", "validatingadmissionpolicy", GUARD, "-o", "json").stdout)
    return p.get("status", {}).get("observedGeneration") == p["metadata"]["generation"]


def measure(cp: ControlPlane, namespace: str, pod: dict[str, Any], pods: int) -> tuple[float, int]:
    asyncio.run(create_many(cp, namespace, WARMUP, 1, pod, lambda: None))
    marks: list[tuple[float, float]] = []
    _, _, failures = asyncio.run(create_many(cp, namespace, pods, 1, pod, lambda: marks.append(policy_plugin_time(cp))))
    (c0, s0), (c1, s1) = marks
    return (s1 - s0) / (c1 - c0) * 1e6, failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=KUBERNETES_VERSIONS[-1])
    parser.add_argument("--pods", type=int, default=150, help="creates per variant and round, one at a time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variables", action="store_true", help="one variant per variable, not per validation")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)

    results: dict[str, list[float]] = {}
    failed = 0
    binaries = control_plane(args.version)
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(binaries, Path(tmp) / "cp") as cp:
        injected = pre_injected_pod(cp)
        hook = start_gpufence(cp, Path(tmp) / "gpufence")
        try:
            add_switches(cp)
            admin = kube.api_client(cp.admin_kubeconfig)
            namespace = kube.create_namespace(admin, "bench-guard", {**kube.OPT_IN, SWITCH_PREFIX + "webhook": "off"})
            shipped = json.loads(cp.kubectl("get", "validatingadmissionpolicy", GUARD, "-o", "json").stdout)
            kube.wait_for(lambda: not kube.create_pod(admin, namespace, bench_pod(), dry_run=True).admitted,
                          "the guard to refuse an uninjected pod", timeout=30)
            runs = variants(shipped["spec"]["validations"],
                            [v["name"] for v in shipped["spec"]["variables"]] if args.variables else None)
            names = list(runs)
            for r in range(args.rounds):
                start_at = r % len(names)
                for name in names[start_at:] + names[:start_at]:
                    install_variant(cp, shipped, runs[name])
                    us, failures = measure(cp, namespace, injected, args.pods)
                    failed += failures
                    results.setdefault(name, []).append(us)
            install_variant(cp, shipped, shipped["spec"]["validations"])
        finally:
            hook.stop()

    base = median(results[names[0]])
    rows = [[name, f"{median(v):.0f}", f"{median(v) - base:+.0f}", " / ".join(f"{x:.0f}" for x in v)]
            for name, v in results.items()]
    first = "variable alone" if args.variables else "validations kept"
    body = table([first, "VAP plugin µs/create", "over none", "per round"], rows)
    if args.variables:  # one row per variable: too long to read inline
        body = f"<details><summary>per variable</summary>\n\n{body}\n\n</details>"
    body += (
        f"\n\nKubernetes {args.version}; {args.rounds} rounds x {args.pods} creates one at a time of the pod as "
        f"gpufence stores it, in an opted-in namespace the webhook skips; the guard admitted all "
        f"({failed} failed). All variables are declared in every variant; CEL evaluates only those a kept "
        f"validation reads.\n")
    print(body)
    if not args.no_write:
        if args.variables:
            write_section("guard_variables", "What each of the guard's variables costs the API server", body)
        else:
            write_section("guard_validations", "What each of the guard's validations costs the API server", body)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
