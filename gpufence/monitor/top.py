"""``gpufence top``: per node and GPU, who uses what of a shared GPU against the share it was given.

:func:`render_text` and :func:`view_json` are pure (a :class:`View` in, text or a JSON-ready dict
out); :func:`run` is the loop that redraws the screen in place with ANSI escapes (the alternate
screen, as ``top`` and ``nvitop`` use it) until ``q`` or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, TextIO

from gpufence.monitor.model import (
    NO_DEVICE,
    ContainerRow,
    EnforcerRow,
    ForeignRow,
    GpuView,
    PodDeviceRow,
    UnaccountedRow,
    View,
)

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(value: float | None) -> str:
    """1536 MiB -> '1.5 GiB'; None -> '-'."""
    if value is None:
        return "-"
    size = float(value)
    for unit in _UNITS:
        if abs(size) < 1024 or unit == _UNITS[-1]:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def bar(ratio: float | None, width: int = 10) -> str:
    """``[#####.....]``, ``[##########]!`` when over 1."""
    if ratio is None:
        return " " * (width + 2)
    filled = max(0, min(width, round(ratio * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]" + ("!" if ratio > 1 else "")


def actions_text(row: ContainerRow) -> str:
    if not row.actions:
        return "-"
    return ", ".join(f"{a.action} {a.resource} x{a.count:g}" for a in row.actions)


COLUMNS = ("NAMESPACE/POD", "CONTAINER", "MEMORY USED / SHARE", "", "SM", "COMPUTE", "HELD BY", "THROTTLED",
           "ACTIONS (total)")


def container_cells(row: ContainerRow) -> tuple[str, ...]:
    share = human_bytes(row.limit_bytes) + (" (%)" if row.limit_from_percent else "")
    if row.uuid == NO_DEVICE:
        memory = "no GPU process"  # its share is exported per device: none to show
    elif row.limit_bytes is None:
        memory = f"{human_bytes(row.used_bytes)} / no share"
    else:
        memory = f"{human_bytes(row.used_bytes)} / {share}"
    return (
        f"{row.namespace}/{row.pod}", row.container, memory, bar(row.memory_ratio), percent(row.sm_ratio),
        percent(row.compute_share), row.mechanism or "-", "yes" if row.throttled else "no", actions_text(row),
    )


def unattributed_cells(pod: PodDeviceRow) -> tuple[str, ...]:
    n = pod.unattributed_processes
    return (f"{pod.namespace}/{pod.pod}", f"(unattributed: {n} process{'es' if n != 1 else ''})",
            f"{human_bytes(pod.unattributed_bytes)}", "", "", "", "", "", "-")


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))).rstrip() for r in rows]


def gpu_header(gpu: GpuView) -> str:
    node = gpu.node or "(node unknown)"
    if gpu.uuid == NO_DEVICE:
        return f"{node}  no GPU process now"
    pods = {(p.namespace, p.pod) for p in gpu.pods} | {(c.namespace, c.pod) for c in gpu.containers}
    budget = [p.budget_bytes for p in gpu.pods if p.budget_bytes is not None]
    shares = f", budgets {human_bytes(sum(budget))}" if budget else ""
    mig = "  MIG: left to MIG's isolation" if any(p.mig_unenforced for p in gpu.pods) else ""
    return (f"{node}  GPU {gpu.gpu}  {gpu.uuid}  used {human_bytes(gpu.used_bytes)} by {len(pods)} "
            f"pod{'s' if len(pods) != 1 else ''}{shares}{mig}")


UNACCOUNTED_COLUMNS = ("NODE", "NAMESPACE/POD", "CONTAINER", "PROCESSES", "GPU MEMORY")


def unaccounted_lines(rows: Sequence[UnaccountedRow],
                      title: str = "GPU processes without an admitted share (node guardian):") -> list[str]:
    """The node guardian's unaccounted containers, or those the admin allowed (none: no lines)."""
    if not rows:
        return []
    cells = [UNACCOUNTED_COLUMNS] + [
        (r.node or "?", f"{r.namespace}/{r.pod}", r.container or "(pod cgroup)", str(r.processes),
         human_bytes(r.memory_bytes)) for r in rows
    ]
    return ["", title, *_table(cells)]


ADMIN_ALLOWED_TITLE = ("GPU processes without a share that the admin's policy allowed (node guardian, "
                       "reported, not ended):")


FOREIGN_TITLE = ("GPU processes of other namespaces and of the host (node guardian, per node: "
                 "no share accounts for them):")
FOREIGN_COLUMNS = ("NODE", "OTHER NAMESPACES", "HOST", "OPTED-IN BESIDE THEM")


def foreign_lines(rows: Sequence[ForeignRow]) -> list[str]:
    """The nodes where the guardian counts GPU processes gpufence does not govern (none: no lines)."""
    if not rows:
        return []
    cells = [FOREIGN_COLUMNS] + [(r.node or "?", str(r.other_namespace), str(r.host), str(r.admitted)) for r in rows]
    return ["", FOREIGN_TITLE, *_table(cells)]


STALE_POLL_SECONDS = 60  # the GpufenceEnforcerPollStale alert's threshold


def enforcer_trouble(e: EnforcerRow, now: float) -> str:
    """Why an enforcer does not see (or act on) everything; "" when nothing is wrong."""
    why = []
    if e.nvml_up is False:
        why.append("NVML down")
    if e.last_poll is not None and now:
        if e.last_poll <= 0:
            why.append("never polled NVML successfully")
        elif now - e.last_poll > STALE_POLL_SECONDS:
            why.append(f"last successful poll {now - e.last_poll:.0f} s ago")
    if e.uninspectable:
        why.append(f"{e.uninspectable} uninspectable process{'es' if e.uninspectable != 1 else ''}")
    return ", ".join(why)


def render_text(view: View, width: int | None = None) -> str:
    """The screen as plain text (what ``--once`` prints). ``width`` cuts long lines."""
    stamp = dt.datetime.fromtimestamp(view.time, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ") if view.time else ""
    pods = {(c.namespace, c.pod) for c in view.containers}
    gpus = [g for g in view.gpus if g.uuid != NO_DEVICE]
    over = sum(1 for c in view.containers if c.over_memory)
    throttled = sum(1 for c in view.containers if c.throttled)
    lines = [
        f"gpufence top  {stamp}  from {view.source}".rstrip(),
        f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}, {len(pods)} pods, "
        f"{len(view.containers)} containers, {over} over their memory share, {throttled} throttled",
    ]
    for error in view.errors:
        lines.append(f"! {error}")
    if not view.gpus:
        lines += ["", "no gpufence enforcer reports a GPU container (is the namespace opted in, is it scraped?)"]
    for gpu in view.gpus:
        rows: list[tuple[str, ...]] = [COLUMNS]
        rows += [container_cells(c) for c in gpu.containers]
        rows += [unattributed_cells(p) for p in gpu.pods if p.unattributed_processes or p.unattributed_bytes]
        lines += ["", gpu_header(gpu), *_table(rows)]
    lines += unaccounted_lines(view.unaccounted)
    lines += unaccounted_lines(view.admin_allowed, ADMIN_ALLOWED_TITLE)
    lines += foreign_lines(view.foreign)
    unhealthy = [(e, why) for e in view.enforcers if (why := enforcer_trouble(e, view.time))]
    if unhealthy:
        lines += ["", "Enforcers that cannot see everything:"]
        lines += [f"  {e.namespace}/{e.pod} on {e.node or '?'}: {why}" for e, why in unhealthy]
    if width:
        lines = [line[:width] for line in lines]
    return "\n".join(lines) + "\n"


def view_json(view: View) -> dict[str, Any]:
    """What ``-o json`` prints: every GPU with its containers and pods, the enforcers, and the node
    guardian's unaccounted containers, those the admin allowed, and the nodes with GPU processes of
    other namespaces or of the host."""
    def container(c: ContainerRow) -> dict[str, Any]:
        doc = asdict(c)
        doc["actions"] = [asdict(a) for a in c.actions]
        doc["memory_ratio"] = c.memory_ratio
        doc["over_memory"] = c.over_memory
        return doc

    return {
        "time": view.time,
        "source": view.source,
        "errors": list(view.errors),
        "gpus": [
            {"node": g.node, "uuid": g.uuid, "gpu": g.gpu, "used_bytes": g.used_bytes,
             "containers": [container(c) for c in g.containers], "pods": [asdict(p) for p in g.pods]}
            for g in view.gpus
        ],
        "enforcers": [asdict(e) for e in view.enforcers],
        "unaccounted": [asdict(u) for u in view.unaccounted],
        "admin_allowed": [asdict(u) for u in view.admin_allowed],
        "foreign": [asdict(f) for f in view.foreign],
    }


# --- the live screen ------------------------------------------------------------------------

ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, cursor hidden
LEAVE = "\x1b[?25h\x1b[?1049l"
HOME = "\x1b[H"
CLEAR_LINE = "\x1b[K"
CLEAR_BELOW = "\x1b[J"


def frame(text: str, height: int | None = None) -> str:
    """One redraw: home, every line cleared to its end, the rest of the screen cleared."""
    lines = text.rstrip("\n").split("\n")
    if height:
        lines = lines[:height]
    return HOME + "".join(line + CLEAR_LINE + "\r\n" for line in lines[:-1]) + lines[-1] + CLEAR_LINE + CLEAR_BELOW


@contextlib.contextmanager
def _cbreak(stream: TextIO) -> Iterator[bool]:
    """Keys without Enter, when ``stream`` is a terminal; yields whether keys can be read."""
    try:
        fd = stream.fileno()
        saved = termios.tcgetattr(fd)
    except (OSError, ValueError, AttributeError, termios.error):  # not a terminal: no keys
        yield False
        return
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(collect: Callable[[], View], interval: float, out: TextIO = sys.stdout, keys: TextIO = sys.stdin) -> int:
    """Redraw every ``interval`` seconds until ``q`` or Ctrl-C."""
    out.write(ENTER)
    try:
        with _cbreak(keys) as can_read:
            while True:
                size = os.get_terminal_size(out.fileno()) if out.isatty() else os.terminal_size((200, 50))
                text = render_text(collect(), size.columns)
                out.write(frame(text + f"\nrefresh every {interval:g} s; q to quit", size.lines))
                out.flush()
                if _wait_for_quit(keys if can_read else None, interval):
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        out.write(LEAVE)
        out.flush()


def _wait_for_quit(keys: TextIO | None, interval: float) -> bool:
    deadline = time.monotonic() + interval
    while (left := deadline - time.monotonic()) > 0:
        if keys is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([keys], [], [], left)
        if ready and os.read(keys.fileno(), 1) in (b"q", b"Q"):
            return True
    return False
