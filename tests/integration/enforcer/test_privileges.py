"""End to end with real credentials: what the enforcer can do without SYS_PTRACE (Pod Security
``baseline`` forbids it), measured with ``setpriv`` capability sets as a container runtime gives them.

* The sidecar as root with the runtime's default capabilities (no ``drop: [ALL]``, no SYS_PTRACE;
  passes ``baseline``) inspects and signals root workloads holding the same default set: it enforces.
* The sidecar with ``drop: [ALL]`` + ``add: [KILL]`` may signal but not read a root workload's
  ``/proc/<pid>/fd``: it cannot tell which container the process is, so it charges it to the pod's
  budget and terminates it when the pod is over (issue 32: a reason to act, not to skip), and says
  so (``process_uninspectable`` log line, Event, ``gpufence_uninspectable_processes``).
* ``restricted`` (the GPU containers' runAsUser, ``drop: [ALL]``): without any capability the sidecar
  enforces on processes of its own user; another user's (which the webhook now refuses to admit
  there) is charged to the pod too, and the signal the kernel refuses is said, never silent.

Why: /proc/<pid>/environ and /proc/<pid>/fd need ptrace read access (the kernel's ptrace access check).
"""

from __future__ import annotations

import os
import shutil

from tests.support.prerequisites import needs

GIB = 1 << 30
INTERVAL = 0.1

# containerd's default capability set for a container (CapEff 00000000a80425fb).
DEFAULT_CAPS = (
    "-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,+net_bind_service,"
    "+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap"
)


def caps(bounding: str) -> tuple[str, ...]:
    return ("setpriv", f"--bounding-set={bounding}", "--inh-caps=-all", "--")


pytestmark = [
    needs(os.geteuid() == 0, reason="needs root to run processes with chosen capability sets"),
    needs(shutil.which("setpriv") is not None, reason="needs setpriv (util-linux)"),
]


def test_runtime_default_capabilities_without_sys_ptrace_enforce(gpu, make_config):
    hog = gpu.workload("hog", wrap=caps(DEFAULT_CAPS))
    calm = gpu.workload("calm", wrap=caps(DEFAULT_CAPS))
    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB), gpu.proc(calm, GIB)))
    config = make_config({"hog": {"memoryBytes": 2 * GIB}, "calm": {"memoryBytes": 2 * GIB}}, grace=5)
    enforcer = gpu.enforcer(config, wrap=caps(DEFAULT_CAPS))
    privileges = enforcer.started["privileges"]
    assert privileges["uid"] == 0 and privileges["cap_kill"] and not privileges["cap_sys_ptrace"]
    hog.wait_line("got SIGTERM", timeout=5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["outcome"] == "sent"
    enforcer.wait_polls(2)
    assert calm.alive()
    assert enforcer.events("process_uninspectable") == []
    assert enforcer.metric("gpufence_uninspectable_processes") == 0
    assert enforcer.stop() == 0


def test_kill_only_cannot_inspect_a_root_workload_says_so_and_charges_it_to_the_pod(gpu, make_config):
    hog = gpu.workload("hog", wrap=caps(DEFAULT_CAPS))
    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)))
    enforcer = gpu.enforcer(make_config({"hog": {"memoryBytes": 2 * GIB}}, grace=5), wrap=caps("-all,+kill"))
    privileges = enforcer.started["privileges"]
    assert privileges["cap_effective"] == "0000000000000020"  # CAP_KILL only
    assert privileges["cap_kill"] and not privileges["cap_sys_ptrace"]
    seen = enforcer.wait_event("process_uninspectable", 5, nvml_pid=hog.pid)
    assert seen["level"] == "error" and "ptrace" in seen["reason"]
    # Said at start too, before any process shows up.
    assert "no CAP_SYS_PTRACE" in enforcer.wait_event("privilege_limit", 5)["limit"]
    # Charged to the pod (its budget is the one container's 2 GiB), so terminated as the pod's (the
    # metric is the count of such processes now: back to 0 once it is gone).
    hog.wait_line("got SIGTERM", timeout=5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["outcome"] == "sent"
    assert len(enforcer.events("process_uninspectable")) == 1  # once, not every poll
    assert enforcer.stop() == 0


# Pod Security `restricted`: the sidecar runs as the GPU containers' runAsUser with `drop: [ALL]`. What the
# kernel decides is "same uid, and the reader's permitted capabilities include the target's" for
# /proc/<pid>/fd and environ, and "same uid or CAP_KILL" for kill(). Shown here with processes that
# have no capabilities at all: the workload as uid 0 (stands for the pod's user; this machine's
# Python lives under /root, which no other uid can reach), and a second workload as uid 65534 (a
# container that sets another runAsUser), which a capability-less sidecar can neither inspect nor
# signal.
NO_CAPS = caps("-all")


def test_same_user_without_capabilities_enforces(gpu, make_config):
    hog = gpu.workload("hog", wrap=NO_CAPS)
    gpu.write(gpu.device_with(gpu.proc(hog, 3 * GIB)))
    enforcer = gpu.enforcer(make_config({"hog": {"memoryBytes": 2 * GIB}}, grace=5), wrap=NO_CAPS)
    assert enforcer.started["privileges"]["cap_effective"] == "0000000000000000"
    limit = enforcer.wait_event("privilege_limit", 5)["limit"]
    assert limit == "no CAP_KILL: can signal only processes of uid 0"
    hog.wait_line("got SIGTERM", timeout=5)
    assert enforcer.wait_event("sigterm", 5, pid=hog.pid)["outcome"] == "sent"
    assert enforcer.stop() == 0


def test_another_user_is_out_of_reach_without_capabilities_and_it_says_so(gpu, make_config):
    import subprocess

    fd = os.open(gpu.device, os.O_RDONLY)  # inherited: uid 65534 cannot open a path under root's tmp
    other = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--bounding-set=-all", "--inh-caps=-all",
         "--", "sleep", "120"],
        pass_fds=(fd,), env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPUFENCE_CONTAINER": "other"},
    )
    os.close(fd)
    try:
        gpu.write(gpu.device_with(gpu.proc(other.pid, 3 * GIB)))
        enforcer = gpu.enforcer(make_config({"other": {"memoryBytes": 2 * GIB}}, grace=5), wrap=NO_CAPS)
        seen = enforcer.wait_event("process_uninspectable", 5, nvml_pid=other.pid)
        assert "another user" in seen["reason"]
        enforcer.wait_polls(3)
        # Charged to the pod and signalled as the pod's; the kernel refuses (another uid, no
        # CAP_KILL), and the refusal is logged, not hidden.
        assert other.poll() is None
        terms = enforcer.events("sigterm")
        assert terms and all(t["outcome"] != "sent" for t in terms), terms
        assert enforcer.metric("gpufence_uninspectable_processes") == 1
        assert enforcer.stop() == 0
    finally:
        other.kill()
        other.wait(5)
