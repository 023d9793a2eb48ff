"""Bytes the injection adds per pod, over the goldens (tests/golden): median, min, max, per golden.

    python -m bench.injected_bytes [--against REF] [--probe-cost [--python PATH]] [--no-write]

For every golden the webhook mutates: the output pod minus the input pod, both compact JSON, as
the webhook's patch leaves it (before the API server's defaults and managed fields). The parts:
the sidecar, the status annotation, what the GPU containers gain, the pod's volumes and the rest
(shareProcessNamespace). ``--against REF`` measures the goldens of a git revision as well, for a
before/after. ``--probe-cost`` times the probe command as the kubelet runs it against a console
script doing the same (pip's wrapper), with ``--python``'s interpreter (one with gpufence installed
from a wheel, as in the image: an editable install's start-up hides the difference).

Target: median <= 1200 bytes, owned here: the report says met or MISSED (what remains is the
sidecar's own spec and the GPU containers' variables, each an enforcement point,
docs/PERFORMANCE.md); tests/unit/webhook/test_injected_bytes.py only keeps the median from growing.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, command_line, table, write_section
from gpufence.contract import PROBE_COMMAND
from tests.support.injected_bytes import ENV_PART, PURPOSE, fields, parts
from tests.support.stats import median

TARGET_MEDIAN_BYTES = 1200


def render_fields(found: dict[str, list[tuple[str, int]]], goldens: int) -> str:
    def cases(item: tuple[str, list[tuple[str, int]]]) -> int:
        return len({case for case, _ in item[1]})

    rows = sorted(found.items(), key=lambda item: (-cases(item), -median([n for _, n in item[1]])))
    return table(["piece", "median bytes", "goldens with it", "what it is for"],
                 [[name, f"{median([n for _, n in sizes]):.0f}", f"{cases((name, sizes))} of {goldens}",
                   PURPOSE.get(name, "?")] for name, sizes in rows])


def _golden_at(ref: str, into: Path) -> Path:
    """tests/golden as of git revision ``ref``, extracted under ``into``."""
    archive = subprocess.run(["git", "archive", ref, "tests/golden"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "tests" / "golden"


def summary(rows: dict[str, dict[str, int]]) -> dict[str, float]:
    keys = next(iter(rows.values())).keys()
    return {key: median([r[key] for r in rows.values()]) for key in keys}


def probe_cost(python: str, runs: int = 60) -> list[tuple[str, float]]:
    """CPU ms per run of the probe command, against pip's console-script wrapper calling the same
    function (no heartbeat to find: the check fails at once, so this is the start-up)."""
    wrapper = ("import re\nimport sys\nfrom gpufence.enforcer.probe import main\nif __name__ == '__main__':\n"
               "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "gpufence-probe"
        script.write_text(f"#!{python}\n{wrapper}")
        script.chmod(0o755)
        commands = [(" ".join(PROBE_COMMAND[:2]) + " ...", [python, *PROBE_COMMAND[1:]]),
                    ("console script (pip's wrapper)", [str(script)])]
        env = {"PATH": "/usr/bin:/bin", "GPUFENCE_STATE_DIR": str(Path(tmp) / "none")}
        totals = {name: 0.0 for name, _ in commands}
        for _ in range(3):  # interleaved rounds: the machine is shared
            for name, argv in commands:
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                for _ in range(runs):
                    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, cwd="/", check=False)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                totals[name] += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return [(name, totals[name] / (3 * runs) * 1000) for name, _ in commands]


def render(rows: dict[str, dict[str, int]], before: dict[str, dict[str, int]] | None, ref: str | None,
           probe: list[tuple[str, float]] | None) -> str:
    now = summary(rows)
    totals = [r["total"] for r in rows.values()]
    verdict = "met" if now["total"] <= TARGET_MEDIAN_BYTES else "MISSED"
    headers = ["", "goldens", "median total", "min", "max", "sidecar", "status", "GPU containers' env", "volumes",
               "rest"]

    def line(name: str, data: dict[str, dict[str, int]]) -> list[Any]:
        m = summary(data)
        values = [r["total"] for r in data.values()]
        return [name, len(data), f"{m['total']:.0f}", min(values), max(values), f"{m['sidecar']:.0f}",
                f"{m['status']:.0f}", f"{m[ENV_PART]:.0f}",
                f"{m['volumes']:.0f}", f"{m['rest']:.0f}"]

    lines = ([line(f"before ({ref})", before)] if before else []) + [line("now", rows)]
    text = table(headers, lines)
    text += (f"\n\nBytes added per mutated golden (compact JSON of the output pod minus the input pod, before "
             f"the API server's defaults and managed fields); the parts are medians of their own, so they need "
             f"not add up to the median total. Target: median <= {TARGET_MEDIAN_BYTES} bytes: **{verdict}** "
             f"({now['total']:.0f}; min {min(totals)}, max {max(totals)}).\n")
    if probe:
        text += "\n" + table(["probe command", "CPU ms per run"], [[n, f"{ms:.1f}"] for n, ms in probe]) + "\n"
        text += ("\nThe probe's start-up, measured as host processes (not in a pod) on the machine named above, "
                 "with PYTHON an interpreter that has gpufence installed from a wheel as in the image "
                 "(`python3 -m venv v && v/bin/pip install .`); the check finds no heartbeat and fails at once.\n")
    text += ("\nWhat each piece costs, over the mutated goldens (median of its sizes: a variable a workload "
             "container gains counts once per container; a piece in few goldens is there only for their "
             "settings or flags):\n\n"
             + render_fields(fields(), len(rows)) + "\n")
    text += "\n<details><summary>per golden</summary>\n\n" + table(
        ["golden", "bytes added", "sidecar", "status"],
        [[case, r["total"], r["sidecar"], r["status"]] for case, r in sorted(rows.items())]) + "\n\n</details>\n"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REF", help="also measure the goldens of this git revision")
    parser.add_argument("--probe-cost", action="store_true", help="time the probe command against a console script")
    parser.add_argument("--python", default=sys.executable, help="interpreter for --probe-cost")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/PERFORMANCE.md")
    args = parser.parse_args(argv)
    rows = parts()
    before = None
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            before = parts(_golden_at(args.against, Path(tmp)))
    text = render(rows, before, args.against, probe_cost(args.python) if args.probe_cost else None)
    print(text)
    if not args.no_write:
        # The interpreter's path is this machine's: the docs name it PYTHON.
        command = command_line().replace(args.python, "PYTHON") if args.probe_cost else None
        write_section("injected_bytes", "Bytes the injection adds per pod (goldens)", text, command=command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
