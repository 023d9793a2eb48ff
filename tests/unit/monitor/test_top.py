"""gpufence top's text, JSON and redraw, from a view built of the enforcer's real exposition text."""

from __future__ import annotations

import json

from gpufence.monitor import top
from gpufence.monitor.model import View
from tests.unit.monitor.test_model import GIB, view


def test_human_bytes_and_bar() -> None:
    assert top.human_bytes(None) == "-"
    assert top.human_bytes(512) == "512 B"
    assert top.human_bytes(1536 << 20) == "1.5 GiB"
    assert top.human_bytes(3 * GIB) == "3.0 GiB"
    assert top.bar(None) == " " * 12
    assert top.bar(0.5) == "[#####.....]"
    assert top.bar(1.25) == "[##########]!"
    assert top.percent(0.905) == "90%"


def test_text_shows_every_container_with_its_numbers() -> None:
    text = top.render_text(view())
    lines = text.splitlines()
    assert lines[0] == "gpufence top  1970-01-01 00:16:41Z  from test"
    assert lines[1] == "1 GPU, 1 pods, 3 containers, 1 over their memory share, 1 throttled"
    assert "node-a  GPU 0  GPU-0  used 9.0 GiB by 1 pod, budgets 8.0 GiB" in lines
    header = next(line for line in lines if "NAMESPACE/POD" in line)
    for column in ("CONTAINER", "MEMORY USED / SHARE", "SM", "COMPUTE", "HELD BY", "THROTTLED", "ACTIONS"):
        assert column in header
    trainer = next(line for line in lines if " trainer " in line).split()
    assert trainer[:8] == ["team-a/train-0", "trainer", "3.0", "GiB", "/", "4.0", "GiB", "[########..]"]
    assert trainer[8:13] == ["90%", "50%", "polling", "yes", "throttle_start"]
    loader = next(line for line in lines if " loader " in line)
    assert "5.0 GiB / 4.0 GiB" in loader and "[##########]!" in loader and "driver" in loader
    assert "sigterm memory x1" in loader
    assert any("(unattributed: 2 processes)" in line and "1.0 GiB" in line for line in lines)


def test_text_cut_to_the_width() -> None:
    assert max(len(line) for line in top.render_text(view(), 40).splitlines()) == 40


def test_nothing_to_show_says_why() -> None:
    text = top.render_text(View(time=0, source="x", errors=("cannot query Prometheus at y",)))
    assert "! cannot query Prometheus at y" in text
    assert "no gpufence enforcer reports a GPU container" in text


def test_json_is_every_field() -> None:
    doc = json.loads(json.dumps(top.view_json(view())))
    (gpu,) = doc["gpus"]
    assert (gpu["node"], gpu["uuid"], gpu["gpu"], gpu["used_bytes"]) == ("node-a", "GPU-0", "0", 9 * GIB)
    rows = {c["container"]: c for c in gpu["containers"]}
    assert rows["loader"]["over_memory"] is True and rows["loader"]["memory_ratio"] == 1.25
    assert rows["trainer"]["actions"] == [{"action": "throttle_start", "resource": "compute", "count": 1.0}]
    assert gpu["pods"][0]["unattributed_processes"] == 2
    assert doc["enforcers"][0]["nvml_up"] is True


def test_frame_redraws_in_place() -> None:
    drawn = top.frame("a\nbb\nccc\n", height=2)
    assert drawn == "\x1b[Ha\x1b[K\r\nbb\x1b[K\x1b[J"


def test_a_container_with_no_gpu_process_now() -> None:
    from gpufence.enforcer.report.metrics import EnforcerMetrics
    from gpufence.monitor.model import build_view
    from gpufence.monitor.sources import parse_metrics

    metrics = EnforcerMetrics("ns", "p")
    metrics.declare_containers(["gone"])
    metrics.action("gone", "sigkill", "memory")
    text = top.render_text(build_view(parse_metrics(metrics.render()[0].decode())))
    assert "0 GPUs, 1 pods, 1 containers" in text
    assert "(node unknown)  no GPU process now" in text
    line = next(x for x in text.splitlines() if " gone " in x)
    assert "no GPU process" in line and "sigkill memory x1" in line


def test_enforcer_trouble() -> None:
    from gpufence.monitor.model import EnforcerRow

    now = 10_000.0
    assert top.enforcer_trouble(EnforcerRow("n", "ns", "p", True, now - 1), now) == ""
    assert top.enforcer_trouble(EnforcerRow("n", "ns", "p", False, 0.0), now) == \
        "NVML down, never polled NVML successfully"
    assert top.enforcer_trouble(EnforcerRow("n", "ns", "p", True, now - 120, 2), now) == \
        "last successful poll 120 s ago, 2 uninspectable processes"


def test_keys_only_from_a_terminal() -> None:
    import io
    import os

    with top._cbreak(io.StringIO()) as can_read:  # no file descriptor
        assert can_read is False
    read, write = os.pipe()
    try:
        with open(read, closefd=False) as pipe, top._cbreak(pipe) as can_read:  # not a terminal
            assert can_read is False
    finally:
        os.close(read)
        os.close(write)


def test_unaccounted_processes_shown_by_node_pod_container_and_memory() -> None:
    from tests.unit.monitor.test_model import guardian_view

    lines = top.render_text(guardian_view()).splitlines()
    start = lines.index("GPU processes without an admitted share (node guardian):")
    header, *rows = lines[start + 1 : start + 4]
    assert header.split() == ["NODE", "NAMESPACE/POD", "CONTAINER", "PROCESSES", "GPU", "MEMORY"]
    assert rows[0].split() == ["node-b", "team-a/alias-0", "cuda", "1", "0", "B"]
    assert rows[1].split() == ["node-b", "team-b/sneaky-0", "main", "2", "3.0", "GiB"]
    assert "without an admitted share" not in top.render_text(view())  # no guardian: no section
    doc = json.loads(json.dumps(top.view_json(guardian_view())))
    assert doc["unaccounted"][1] == {"node": "node-b", "namespace": "team-b", "pod": "sneaky-0", "container": "main",
                                     "processes": 2, "memory_bytes": 3 * GIB}
    assert json.loads(json.dumps(top.view_json(view())))["unaccounted"] == []
    # Those the admin's policy allowed: a section of their own, after the unaccounted.
    start = lines.index(top.ADMIN_ALLOWED_TITLE)
    assert start > lines.index("GPU processes without an admitted share (node guardian):")
    assert lines[start + 2].split() == ["node-b", "gpu-operator/dcgm-exporter-0", "exporter", "1", "1.0", "GiB"]
    assert doc["admin_allowed"] == [{"node": "node-b", "namespace": "gpu-operator", "pod": "dcgm-exporter-0",
                                     "container": "exporter", "processes": 1, "memory_bytes": GIB}]


def test_other_namespaces_and_host_processes_shown_per_node() -> None:
    from tests.unit.monitor.test_model import guardian_view

    lines = top.render_text(guardian_view()).splitlines()
    start = lines.index(top.FOREIGN_TITLE)
    assert start > lines.index(top.ADMIN_ALLOWED_TITLE)
    header, row = lines[start + 1 : start + 3]
    assert [c.strip() for c in header.split("  ") if c.strip()] == list(top.FOREIGN_COLUMNS)
    assert row.split() == ["node-b", "1", "2", "1"]
    assert top.FOREIGN_TITLE not in top.render_text(view())  # no guardian: no section
    doc = json.loads(json.dumps(top.view_json(guardian_view())))
    assert doc["foreign"] == [{"node": "node-b", "other_namespace": 1, "host": 2, "admitted": 1}]
    assert top.view_json(view())["foreign"] == []
