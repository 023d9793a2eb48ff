"""The census's cgroup parsing over the paths the kubelet and the runtimes write (cgroupfs and systemd
drivers, cgroup v1, v2 and hybrid hosts)."""

from __future__ import annotations

import pytest

from gpufence.node.census import HOST, parse_cgroup_file, placement, pod_and_container

UID = "6f1c2b8e-9a3d-4c1e-8f7a-0123456789ab"
SYSTEMD_UID = UID.replace("-", "_")
CID = "3f9a" * 16  # 64 hex digits, as containerd writes them

V1_CGROUPFS = f"""12:freezer:/kubepods/burstable/pod{UID}/{CID}
11:pids:/kubepods/burstable/pod{UID}/{CID}
10:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}
9:memory:/kubepods/burstable/pod{UID}/{CID}
1:name=systemd:/kubepods/burstable/pod{UID}/{CID}
0::/
"""

V2_SYSTEMD = (
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n"
)

V1_SYSTEMD_GUARANTEED = f"""7:freezer:/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope
6:pids:/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope
"""


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (V1_CGROUPFS, f"/kubepods/burstable/pod{UID}/{CID}"),
        (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", f"/kubepods/besteffort/pod{UID}/{CID}"),
        (f"0::/kubepods/pod{UID}/{CID}\n", f"/kubepods/pod{UID}/{CID}"),  # guaranteed QoS: no class segment
        (V2_SYSTEMD, V2_SYSTEMD[3:].strip()),
        (V1_SYSTEMD_GUARANTEED, V1_SYSTEMD_GUARANTEED.splitlines()[0].split(":", 2)[2]),
        # CRI-O and dockershim scopes, and a node nested in another's container (kind).
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/crio-{CID}.scope",
         None),
        (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
         f"kubelet-kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope", None),
    ],
)
def test_a_container_cgroup_names_its_pod_and_container(text: str, path: str | None) -> None:
    where = placement(text)
    assert where.pod_uid == UID
    assert where.container_id == CID
    if path is not None:
        assert where.path == path


def test_v1_lines_give_the_freezer_path_and_v2_the_unified_one() -> None:
    v1 = placement(V1_CGROUPFS)
    assert v1.freezer == f"/kubepods/burstable/pod{UID}/{CID}"
    assert v1.unified == "/"  # the hybrid host's v2 line: every process at its root
    v2 = placement(V2_SYSTEMD)
    assert v2.freezer is None
    assert v2.unified == v2.path


def test_host_processes_are_in_no_pod() -> None:
    for text in (
        "0::/system.slice/containerd.service\n",
        "12:freezer:/\n11:pids:/user.slice/user-0.slice\n0::/\n",
        "0::/\n",
        "",
    ):
        where = placement(text)
        assert where.pod_uid is None and where.container_id is None and not where.in_pod
    assert placement(None) is HOST


def test_the_pods_own_cgroup_and_the_sandbox_name_no_container() -> None:
    assert pod_and_container(f"/kubepods/burstable/pod{UID}") == (UID, None)
    assert pod_and_container(f"/kubepods/burstable/pod{UID}/not-a-container") == (UID, None)
    # A container cgroup below the container (a process that made its own): still that container.
    assert pod_and_container(f"/kubepods/burstable/pod{UID}/{CID}/inner") == (UID, CID)


def test_a_cgroup_the_container_made_is_the_container() -> None:
    where = placement(f"12:freezer:/kubepods/pod{UID}/{CID}/worker\n0::/kubepods/pod{UID}/{CID}/worker/a\n")
    assert where.container_id == CID
    assert where.path == where.unified == where.freezer == f"/kubepods/pod{UID}/{CID}"


def test_a_nested_node_takes_the_innermost_pod() -> None:
    outer = "0" * 8 + "-1111-2222-3333-" + "4" * 12
    path = f"/kubepods/burstable/pod{outer}/{'a' * 64}/kubepods/besteffort/pod{UID}/{CID}"
    assert pod_and_container(path) == (UID, CID)


def test_malformed_lines_are_skipped() -> None:
    parsed = parse_cgroup_file(f"garbage\n12:freezer\n3:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n")
    assert parsed.unified is None
    assert parsed.v1["cpu"] == parsed.v1["cpu,cpuacct"] == f"/kubepods/pod{UID}/{CID}"
    assert placement(f"garbage\n3:cpu,cpuacct:/kubepods/pod{UID}/{CID}\n").container_id == CID


def test_uppercase_uid_is_normalised() -> None:
    assert pod_and_container(f"/kubepods/pod{UID.upper()}/{CID}") == (UID, CID)
