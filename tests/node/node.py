"""A real node for the test control plane: containerd + runc (Debian) and a kubelet (pinned module).

Configured like a kubeadm node where it matters to gpufence, with what this machine allows:

* cgroup v1 (these machines mount v1 controllers separately, plus an empty cgroup2 at
  /sys/fs/cgroup/unified), the ``cgroupfs`` driver (no systemd here), kubelet 1.30 (the last minor
  that runs on cgroup v1 without being told to);
* the kubelet authenticates as ``system:node:<name>`` (group ``system:nodes``), so the API server's
  Node authorizer applies to it as in a real cluster; it registers its Node itself;
* pod networking through CNI (Debian's ``bridge`` + ``host-local`` + ``loopback`` plugins);
* there is no kube-proxy: one iptables DNAT rule sends the ``kubernetes`` Service's ClusterIP
  (10.96.0.1:443) to the API server on loopback, which is what kube-proxy would do for that one
  Service (the enforcer's Kubernetes Events go there);
* no scheduler: tests set ``spec.nodeName`` themselves, as the scheduler's binding would;
* the images come from ``tests.node.images`` (imported, never pulled).

Only NVML is simulated: the simulator's library and state file are in a host directory that the
node's OCI runtime wrapper (``tests.node.simruntime``) mounts into the sidecar, as the NVIDIA
container toolkit mounts the real driver's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpufence.certs import pki
from gpufence.simnvml import build_library
from tests.e2e.cluster_pki import client_cert
from tests.e2e.controlplane import Component, ControlPlane, StartupFailed, free_port, start, write_kubeconfig
from tests.node import driver_hook, images, simruntime

NODE_NAME = "gf-node"
BRIDGE = "gfcni0"
POD_SUBNET = "10.244.0.0/24"
CLUSTER_IP = "10.96.0.1"  # the `kubernetes` Service (first address of --service-cluster-ip-range)
GPU_RESOURCE = "nvidia.com/gpu"
GPUS = 16  # what the node advertises (time-slicing replicas of one simulated GPU, as the device plugin would)
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
STARTUP_TIMEOUT_S = 120.0


class NodeUnavailable(RuntimeError):
    """A prerequisite of the node is missing: the node tests skip with this reason."""


def _which(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if path is None:
        raise NodeUnavailable(f"{name} is not installed (run scripts/install_system_deps.sh as root, or make test)")
    return path


def cni_bin_dir() -> str:
    for directory in CNI_DIRS:
        if all(os.path.exists(os.path.join(directory, p)) for p in ("bridge", "host-local", "loopback")):
            return directory
    raise NodeUnavailable("the CNI plugins are not installed (Debian's containernetworking-plugins; "
                          "run scripts/install_system_deps.sh as root, or make test)")


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise NodeUnavailable("the node (containerd, runc, kubelet) needs root")
    for tool in ("containerd", "runc", "ctr", "iptables"):
        _which(tool)
    cni_bin_dir()


def cgroup_version() -> str:
    """What /sys/fs/cgroup is: "v2" (unified), "v1" or "hybrid" (v1 controllers plus an empty v2)."""
    fstype = subprocess.run(["stat", "-f", "-c", "%T", "/sys/fs/cgroup"], capture_output=True, text=True).stdout.strip()
    if fstype == "cgroup2fs":
        return "v2"
    return "hybrid" if os.path.ismount("/sys/fs/cgroup/unified") else "v1"


@dataclass
class Node:
    name: str
    workdir: Path
    cp: ControlPlane
    sim_dir: Path  # hostPath: libnvidia-ml.so.1 (the simulator), its state file, the stand-in device
    containerd_socket: Path
    components: list[Component] = field(default_factory=list)
    cleanups: list[list[str]] = field(default_factory=list)

    @property
    def ctr(self) -> list[str]:
        return ["ctr", "--address", str(self.containerd_socket)]

    @property
    def state_file(self) -> Path:
        return self.sim_dir / "state"

    @property
    def device_file(self) -> Path:
        return self.sim_dir / "nvidia0"

    def check_alive(self) -> None:
        for component in self.components:
            component.check_alive()

    def task_pid(self, container_id: str) -> int | None:
        """The host PID of a container's init process (containerd's task), None when not running."""
        cid = container_id.split("://", 1)[-1]
        result = subprocess.run([*self.ctr, "-n", "k8s.io", "tasks", "ls"], capture_output=True, text=True)
        for line in result.stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[0] == cid and parts[2] == "RUNNING":
                return int(parts[1])
        return None

    def log(self, component: str) -> str:
        for c in self.components:
            if c.name == component:
                return c.log_tail(20000)
        return ""

    def restart_kubelet(self) -> int:
        """Stops the kubelet (SIGTERM: it exits, the containers go on under containerd, as when
        systemd restarts a kubelet) and starts it again with the same flags, its log appended to the
        first one's; returns once the new one answers its health check, with the offset of its
        first line in the log (``log_since``)."""
        index, old = next((i, c) for i, c in enumerate(self.components) if c.name == "kubelet")
        old.stop()
        offset = old.log.stat().st_size
        argv = [str(a) for a in old.process.args]
        with open(old.log, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        self.components[index] = Component("kubelet", process, old.log)
        port = yaml.safe_load((self.workdir / "kubelet.yaml").read_text())["healthzPort"]
        _wait("the restarted kubelet's health check", lambda: _healthy(port), self)
        return offset

    def log_since(self, component: str, offset: int) -> str:
        """The component's log from byte ``offset`` on."""
        log = next(c.log for c in self.components if c.name == component)
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        # The kubelet first (it would restart what we stop), then every container containerd
        # still runs (pods the tests left), then containerd, then what the node set up on the host.
        for component in reversed(self.components):
            if component.name == "kubelet":
                component.stop()
        tasks = subprocess.run([*self.ctr, "-n", "k8s.io", "tasks", "ls", "-q"], capture_output=True, text=True)
        for task in tasks.stdout.split():
            subprocess.run([*self.ctr, "-n", "k8s.io", "tasks", "kill", "-s", "SIGKILL", "--all", task],
                           capture_output=True)
        for task in tasks.stdout.split():
            # Deleting a task reaps it and lets its shim exit (stopping containerd alone does not).
            subprocess.run([*self.ctr, "-n", "k8s.io", "tasks", "delete", "--force", task], capture_output=True)
        for component in self.components:
            if component.name != "kubelet":
                component.stop()
        _stop_shims(self.containerd_socket)
        for argv in reversed(self.cleanups):
            subprocess.run(argv, capture_output=True)
        _unmount_below(self.workdir)


def _stop_shims(socket: Path) -> None:
    """containerd-shim-runc-v2 processes of this node's containerd (their -address is our socket)
    that outlived it: each runs in a session of its own, so nothing else ends them."""
    marker = f"-address\0{socket}\0".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _unmount_below(directory: Path) -> None:
    """Kubelet volume mounts and containerd's rootfs/shm mounts left under the work directory."""
    prefix = str(directory) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.read().strip() == b"ok"
    except OSError:
        return False


def _wait(what: str, condition, node: Node | None = None, timeout: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node is not None:
            node.check_alive()
        if condition():
            return
        time.sleep(0.2)
    raise StartupFailed(f"timed out after {timeout:.0f}s waiting for {what}")


def _containerd_config(workdir: Path, socket: Path, cni_conf: Path, runtime: str, more_runtimes: str = "") -> str:
    # Version 2 config of containerd 1.6 (Debian bookworm). runc through the v2 shim with cgroupfs
    # (SystemdCgroup false), like the kubelet's cgroupDriver; overlayfs snapshots; our CNI config.
    return f"""version = 2
root = "{workdir / 'containerd-root'}"
state = "{workdir / 'containerd-state'}"
[grpc]
  address = "{socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images.PAUSE_IMAGE}"
  # These machines withhold CAP_SYS_RESOURCE even from root (CapBnd 0x1fffeffffff: bit 24 clear),
  # so nobody may lower an oom_score_adj below their own (0). containerd asks runc for -998 on
  # every sandbox, and runc's nsexec then dies: "failed to update /proc/self/oom_score_adj:
  # Permission denied" ("can't get final child's PID from pipe: EOF"). This option, meant for
  # rootless containerd, clamps the requested scores to containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{runtime}"
{more_runtimes}  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin_dir()}"
    conf_dir = "{cni_conf}"
"""


def _cni_config(workdir: Path) -> dict[str, object]:
    return {
        "cniVersion": "0.4.0", "name": "gpufence-node",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(workdir / "cni-ipam")}},
        ],
    }


def _kubelet_config(workdir: Path, socket: Path, ca_cert: Path) -> dict[str, object]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "containerRuntimeEndpoint": f"unix://{socket}",
        "cgroupDriver": "cgroupfs",
        # No swap here, but a test bed must not refuse a machine that has some.
        "failSwapOn": False,
        "address": "127.0.0.1", "port": free_port(), "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(ca_cert)}},
        "authorization": {"mode": "AlwaysAllow"},
        "tlsCertFile": "", "tlsPrivateKeyFile": "",
        # The images are imported, never pulled: image GC must never delete them, and a shared
        # test machine's disk must not evict the test pods.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        # Quicker reactions than production defaults (status, ConfigMaps, restarts are awaited).
        "nodeStatusUpdateFrequency": "2s", "syncFrequency": "5s",
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        "staticPodPath": str(workdir / "manifests"),
    }


def start_node(cp: ControlPlane, name: str = NODE_NAME) -> Node:
    """containerd, images, CNI, the kubelet registered as ``name``; returns when the Node is Ready."""
    check_prerequisites()
    from tests.node.binaries import kubelet as build_kubelet

    kubelet_bin = build_kubelet()
    pause, gpufence_image = images.pause_image(), images.gpufence_image()
    # A short path of our own under /tmp, world-searchable: the sidecar may run as a non-root user
    # and must read the simulator's files through a hostPath; unix socket paths stay short.
    workdir = Path(tempfile.mkdtemp(prefix="gfnode-", dir="/tmp"))
    workdir.chmod(0o755)
    sim_dir = workdir / "sim"
    sim_dir.mkdir(mode=0o755)
    shutil.copy(build_library(), sim_dir / "libnvidia-ml.so.1")
    (sim_dir / "libnvidia-ml.so.1").chmod(0o755)
    (sim_dir / "nvidia0").touch(mode=0o666)
    (sim_dir / "nvidia0").chmod(0o666)
    (workdir / "manifests").mkdir()
    socket = workdir / "containerd.sock"
    node = Node(name, workdir, cp, sim_dir, socket)
    try:
        cni_conf = workdir / "cni"
        cni_conf.mkdir()
        (cni_conf / "10-gpufence-node.conflist").write_text(json.dumps(_cni_config(workdir)))
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)  # a previous run's leftover
        node.cleanups.append(["ip", "link", "delete", BRIDGE])
        config = workdir / "containerd.toml"
        # runc behind the simulated driver's runtime wrapper (what the NVIDIA container toolkit
        # does for the real driver); GPUFENCE_NODE_RUNC swaps runc for another OCI runtime.
        runc = os.environ.get("GPUFENCE_NODE_RUNC") or _which("runc")
        runtime = simruntime.install(str(workdir / "runc-simnvml"), str(sim_dir), runc)
        # Three more handlers that run NVIDIA's real memory-limit hook (RuntimeClasses the tests create).
        hook_runtimes = driver_hook.configure(workdir, sim_dir, runc)
        config.write_text(_containerd_config(workdir, socket, cni_conf, runtime, hook_runtimes))
        node.components.append(start("containerd", [_which("containerd"), "--config", str(config)], workdir))
        _wait("containerd's socket", lambda: subprocess.run(
            [*node.ctr, "version"], capture_output=True).returncode == 0, node, 30)
        for image in (pause, gpufence_image):
            images.import_image(node.ctr, image)

        _route_cluster_ip(node)

        if cp.pki.ca_key is None:
            raise NodeUnavailable("the control plane's PKI kept no CA key to sign the kubelet's certificate")
        ca = pki.KeyPair(pki.load_cert(cp.pki.ca_cert.read_bytes()), pki.load_key(cp.pki.ca_key.read_bytes()))
        identity = client_cert(ca, f"system:node:{name}", ("system:nodes",))
        (workdir / "kubelet.crt").write_bytes(identity.cert_pem)
        (workdir / "kubelet.key").write_bytes(identity.key_pem)
        (workdir / "kubelet.key").chmod(0o600)
        kubeconfig = write_kubeconfig(workdir / "kubelet.kubeconfig", cp.server, cp.pki.ca_cert,
                                      cert=workdir / "kubelet.crt", key=workdir / "kubelet.key",
                                      user=f"system:node:{name}")
        kubelet_config = workdir / "kubelet.yaml"
        kubelet_config.write_text(yaml.safe_dump(_kubelet_config(workdir, socket, cp.pki.ca_cert)))
        node.components.append(start("kubelet", [
            str(kubelet_bin), f"--config={kubelet_config}", f"--kubeconfig={kubeconfig}",
            f"--root-dir={workdir / 'kubelet'}", f"--cert-dir={workdir / 'kubelet-pki'}",
            f"--hostname-override={name}", "--v=2",
        ], workdir))
        _wait(f"Node {name} Ready", lambda: _node_ready(cp, name), node)
        _advertise_gpus(cp, name)
    except BaseException:
        node.stop()
        raise
    return node


def _route_cluster_ip(node: Node) -> None:
    """kube-proxy's job for the one Service pods need: 10.96.0.1:443 -> the API server on loopback.

    DNAT to 127.0.0.1 needs route_localnet on the incoming interface (kube-proxy sets it too for
    NodePorts on localhost); both are undone when the node stops.
    """
    port = node.cp.server.rsplit(":", 1)[1]
    rule = ["PREROUTING", "-t", "nat", "-p", "tcp", "-d", CLUSTER_IP, "--dport", "443",
            "-j", "DNAT", "--to-destination", f"127.0.0.1:{port}", "-m", "comment", "--comment", "gpufence-node"]
    # A run killed before its teardown (a CI timeout) leaves its rule behind, pointing at a dead
    # port; it would match first. Remove every rule of ours before adding this run's.
    listed = subprocess.run(["iptables", "-t", "nat", "-S", "PREROUTING"], check=True, capture_output=True, text=True)
    for line in listed.stdout.splitlines():
        if "gpufence-node" in line and line.startswith("-A "):
            subprocess.run(["iptables", "-t", "nat", "-D", *shlex.split(line)[1:]], check=False, capture_output=True)
    subprocess.run(["iptables", "-A", *rule], check=True, capture_output=True)
    node.cleanups.append(["iptables", "-D", *rule])
    previous = Path("/proc/sys/net/ipv4/conf/all/route_localnet").read_text().strip()
    Path("/proc/sys/net/ipv4/conf/all/route_localnet").write_text("1")
    node.cleanups.append(["sh", "-c", f"echo {previous} > /proc/sys/net/ipv4/conf/all/route_localnet"])


def _node_ready(cp: ControlPlane, name: str) -> bool:
    result = cp.kubectl("get", "node", name, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout)["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _advertise_gpus(cp: ControlPlane, name: str) -> None:
    """What the NVIDIA device plugin would advertise; the documented manual way (status PATCH)."""
    cp.kubectl("patch", "node", name, "--subresource=status", "--type=json", "-p", json.dumps(
        [{"op": "add", "path": f"/status/capacity/{GPU_RESOURCE.replace('/', '~1')}", "value": str(GPUS)}]))
    _wait("the node to advertise nvidia.com/gpu", lambda: json.loads(
        cp.kubectl("get", "node", name, "-o", "json").stdout)["status"].get("allocatable", {}).get(GPU_RESOURCE)
        == str(GPUS), timeout=30)


@contextlib.contextmanager
def running_node(cp: ControlPlane) -> Iterator[Node]:
    node = start_node(cp)
    try:
        yield node
    finally:
        node.stop()
        shutil.rmtree(node.workdir, ignore_errors=True)
