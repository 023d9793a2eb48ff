"""docs/install.md's shell blocks run, as written, against a real control plane: a renamed
manifest path, flag, object or console script breaks this suite, not an operator's install.

Every ```sh block of docs/install.md is either run here or marked, on the line before it, with
``<!-- not-runnable: REASON -->`` (building images needs a Docker engine; logs, port-forward and a
webhook reached through its Service need nodes). ``test_every_shell_block_is_run_or_marked`` fails
for a block that is neither, so a new block cannot go untested silently.

How a block runs: ``bash -euo pipefail`` in a directory laid out like a checkout (``k8s/`` and
``charts/`` of this repository, and the doc's own example pod saved as ``gpu-pod.yaml``, as the doc
says), with ``KUBECONFIG`` naming the test control plane's admin, and ``PATH`` holding kubectl, the
helm binary built from its pinned module (tests/support/helm_binary.py) and this checkout's console
scripts (``gpufence-certs``). The one rewrite: a line documented as refused (``CMD  # refused:
'MESSAGE ...'``) must fail, with MESSAGE in its output. Image names stay as written: no image is
pulled, since there is no node.

The control plane has no node, so a stand-in plays the kubelet for gpufence's own pods and for no
others (``StandInNode``): a pod of the certificate Job runs its container's command and arguments
here, as the Job's ServiceAccount (so the Job's RBAC and flags are the real ones), and is retried
as ``restartPolicy: OnFailure`` would until it succeeds; a webhook pod becomes Ready once Secret
gpufence-webhook-tls exists (its volume, which the kubelet needs before it starts the container).
The Job and Deployment controllers of the real kube-controller-manager complete the Job and the
rollout from those pod states, so the doc's ``kubectl wait`` and ``kubectl rollout status`` wait
for the real thing. The webhook process itself is not started here (the other e2e tests run it).

One control plane, Kubernetes 1.30 (the oldest supported): the blocks use no version-dependent API.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpufence import __version__
from tests.e2e import kube
from tests.e2e.binaries import KUBERNETES_VERSIONS, GoMissing, crd_files
from tests.e2e.controlplane import ControlPlane, control_plane_for
from tests.e2e.gpufence_install import NAMESPACE, REPO, cli, service_account_kubeconfig
from tests.support.prerequisites import missing

INSTALL = REPO / "docs" / "install.md"
NOT_RUNNABLE = re.compile(r"^<!-- not-runnable: (?P<reason>\S.*?) -->$")
REFUSED = re.compile(r"^(?P<command>\S.*?)\s+# refused: '(?P<message>[^']*?)(?: \.\.\.)?'\s*$")
BLOCK_TIMEOUT_S = 300.0
USER_NAMESPACE = "team-a"  # the doc's example namespace
IMAGE = f"registry.example.com/platform/gpufence:{__version__}"  # the doc's own image name


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    script: str
    not_runnable: str | None  # the reason, where marked

    @property
    def first_command(self) -> str:
        return next(line for line in self.script.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def shell_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = NOT_RUNNABLE.match(lines[i - 1].strip()) if i else None
            blocks.append(Block(i + 1, "\n".join(lines[i + 1:end]) + "\n", marker["reason"] if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = shell_blocks(INSTALL.read_text())

# The runnable blocks, by their first command, in the order the tests below run them.
KUSTOMIZE_STEPS = (
    "kubectl label namespace team-a pod-security.kubernetes.io/enforce=baseline",  # Prerequisites
    "kubectl apply -k k8s/",  # Install
    "kubectl label namespace team-a gpufence.io/injection=enabled",  # Opt in a namespace
    "kubectl -n gpufence get pods -l app.kubernetes.io/name=gpufence-webhook",  # Verify
    "kubectl -n gpufence scale deployment/gpufence-webhook --replicas=0",  # Verify: the outage policy
    "kubectl delete validatingadmissionpolicybinding gpufence-guard",  # Upgrade
    "kubectl delete mutatingwebhookconfiguration gpufence",  # Uninstall
)
HELM_STEPS = (
    "helm install gpufence charts/gpufence --set image.repository=",  # Point the install at your image
    "helm install gpufence charts/gpufence \\",  # Install with Helm
)


def block(first_command: str) -> Block:
    """The one runnable block whose first command starts with ``first_command``."""
    (found,) = [b for b in BLOCKS if b.not_runnable is None and b.first_command.startswith(first_command)]
    return found


def test_every_shell_block_is_run_or_marked() -> None:
    steps = KUSTOMIZE_STEPS + HELM_STEPS
    unclaimed = [f"docs/install.md:{b.line}: {b.first_command}" for b in BLOCKS
                 if b.not_runnable is None and not any(b.first_command.startswith(s) for s in steps)]
    assert not unclaimed, ("a ```sh block that this test does not run: add it to a step here, or mark it "
                           "'<!-- not-runnable: REASON -->' on the line before it:\n" + "\n".join(unclaimed))
    for step in steps:
        block(step)  # each step names exactly one runnable block
    marked = [b for b in BLOCKS if b.not_runnable is not None]
    assert any("docker build" in b.script for b in marked), "the image build is marked, not silently dropped"
    assert len(BLOCKS) - len(marked) == len(steps)


def test_shell_blocks_are_parsed_with_their_markers() -> None:
    text = "x\n<!-- not-runnable: needs a node -->\n```sh\n# c\nkubectl get ns\n```\n```sh\nls\n```\n"
    assert shell_blocks(text) == [Block(3, "# c\nkubectl get ns\n", "needs a node"), Block(7, "ls\n", None)]
    assert shell_blocks(text)[0].first_command == "kubectl get ns"


def as_run(script: str) -> str:
    """``script`` with each line documented as refused turned into a check that it is."""
    out = []
    for line in script.splitlines():
        refused = REFUSED.match(line)
        if refused is None:
            out.append(line)
            continue
        command, message = refused["command"], refused["message"]
        out.append(f"if out=$({command} 2>&1); then echo {shlex.quote('documented as refused, but it ran: ' + command)}"
                   f" >&2; exit 1; fi; grep -qF -- {shlex.quote(message)} <<<\"$out\" || "
                   f"{{ echo \"refused without {message}: $out\" >&2; exit 1; }}")
    return "\n".join(out) + "\n"


def test_a_refused_line_must_fail_with_its_message() -> None:
    def status(line: str) -> int:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", as_run(line)], capture_output=True,
                              check=False).returncode

    assert status("sh -c 'echo boom; exit 3'   # refused: 'boom ...'") == 0
    assert status("true                        # refused: 'boom ...'") == 1
    assert status("sh -c 'echo bang; exit 3'   # refused: 'boom ...'") == 1
    assert status("true   # a comment, not a refusal") == 0


# ---------------------------------------------------------------------------------------------
# The bed: a control plane, a checkout-like directory, and the kubelet's part for gpufence's pods.


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StandInNode:
    """The kubelet's part for the pods in namespace gpufence (module docstring)."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.workdir = workdir
        self.api = client.CoreV1Api(kube.api_client(cp.admin_kubeconfig))
        self.done: set[str] = set()
        self.runs: list[str] = []  # what each certificate Job container run printed
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stand-in-node", daemon=True)

    def __enter__(self) -> StandInNode:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._tick()
            except Exception as exc:  # surfaced by the tests' messages, not lost in a thread
                self.errors.append(repr(exc))

    def _tick(self) -> None:
        for pod in self.api.list_namespaced_pod(NAMESPACE).items:
            meta = pod.metadata
            if meta.uid in self.done or meta.deletion_timestamp or pod.status.phase != "Pending":
                continue
            labels = meta.labels or {}
            if "batch.kubernetes.io/job-name" in labels or "job-name" in labels:
                if self._run_job_container(pod):
                    self._set_status(pod, {"phase": "Succeeded", "conditions": [
                        {"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": _now()}]})
                    self.done.add(meta.uid)
            elif labels.get("app.kubernetes.io/name") == "gpufence-webhook" and self._secret_exists():
                self._set_status(pod, {"phase": "Running", "startTime": _now(), "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": _now()}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")], "containerStatuses": [
                    {"name": c.name, "image": c.image, "imageID": "", "ready": True, "started": True,
                     "restartCount": 0, "state": {"running": {"startedAt": _now()}}} for c in pod.spec.containers]})
                self.done.add(meta.uid)

    def _run_job_container(self, pod: Any) -> bool:
        """The pod's one container's command and arguments, here, as the pod's ServiceAccount."""
        (container,) = pod.spec.containers
        account = pod.spec.service_account_name
        kubeconfig = service_account_kubeconfig(self.cp, NAMESPACE, account, self.workdir / f"{account}.kubeconfig")
        argv = [cli(container.command[0]), *container.command[1:], *(container.args or []),
                f"--kubeconfig={kubeconfig}"]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        self.runs.append(f"{pod.metadata.name}: exit {result.returncode}: "
                         f"{result.stdout[-500:]}{result.stderr[-1500:]}")
        return result.returncode == 0

    def _secret_exists(self) -> bool:
        try:
            self.api.read_namespaced_secret("gpufence-webhook-tls", NAMESPACE)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    def _set_status(self, pod: Any, status: dict[str, Any]) -> None:
        self.api.patch_namespaced_pod_status(pod.metadata.name, NAMESPACE, {"status": status})

    def report(self) -> str:
        return "stand-in node: runs:\n" + "\n".join(self.runs[-5:]) + "\nerrors:\n" + "\n".join(self.errors[-5:])


@dataclass
class Bed:
    cp: ControlPlane
    checkout: Path
    env: dict[str, str]
    node: StandInNode
    helm: Path

    def run(self, first_command: str) -> str:
        """Run the block; its output. Fails the test, with the output, unless it exits 0."""
        found = block(first_command)
        process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", as_run(found.script)], cwd=self.checkout,
                                   env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"docs/install.md:{found.line} did not end within {BLOCK_TIMEOUT_S:g}s:\n{output[-3000:]}\n"
                        + self.node.report())
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # whatever the block left in the background
        assert process.returncode == 0, (f"docs/install.md:{found.line} exited {process.returncode}:\n"
                                         f"{output[-3000:]}\n{self.node.report()}")
        return output

    def get(self, *args: str, namespace: str | None = None) -> Any:
        ns = ["-n", namespace] if namespace else []
        result = self.cp.kubectl("get", *args, *ns, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def start_clean(self) -> None:
        """No gpufence in the cluster: what an earlier test that failed half-way left is removed."""
        if self.get("namespace", NAMESPACE) is not None or self.get("mutatingwebhookconfiguration", "gpufence"):
            subprocess.run([str(self.helm), "uninstall", "gpufence"], env=self.env, capture_output=True, timeout=120,
                           check=False)  # fmt: skip
            self.cp.kubectl("delete", "-k", str(REPO / "k8s"), "--ignore-not-found", check=False)
        self.wait_uninstalled()

    def wait_uninstalled(self) -> None:
        kube.wait_for(lambda: self.get("namespace", NAMESPACE) is None, "namespace gpufence to be deleted",
                      timeout=180, interval=0.5)


def example_pod() -> str:
    """The doc's example pod (section "Annotate a pod"), which the Verify section calls gpu-pod.yaml."""
    text = INSTALL.read_text()
    section = text[text.index("\n## Annotate a pod\n"):]
    return re.search(r"```yaml\n(.*?)```", section, re.DOTALL)[1]


@pytest.fixture(scope="module")
def bed(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    version = KUBERNETES_VERSIONS[0]
    with control_plane_for(version, tmp_path_factory.mktemp(f"install-doc-k8s-{version}")) as cp:
        checkout = cp.workdir / "checkout"
        checkout.mkdir()
        for name in ("k8s", "charts"):
            (checkout / name).symlink_to(REPO / name)
        (checkout / "gpu-pod.yaml").write_text(example_pod())
        env = dict(os.environ, KUBECONFIG=str(cp.admin_kubeconfig), HOME=str(cp.workdir),
                   PATH=os.pathsep.join([str(helm.parent), str(Path(sys.executable).parent), os.environ["PATH"]]))
        with StandInNode(cp, cp.workdir) as node:
            yield Bed(cp, checkout, env, node, helm)


# ---------------------------------------------------------------------------------------------
# The kustomize install's life, block by block, in the order an operator runs them.


def test_kustomize_install_opt_in_verify_upgrade_and_uninstall_blocks(bed: Bed) -> None:
    cp = bed.cp
    bed.start_clean()
    cp.kubectl("create", "namespace", USER_NAMESPACE)  # the operator's namespace, which the doc assumes

    bed.run(KUSTOMIZE_STEPS[0])
    assert bed.get("namespace", USER_NAMESPACE)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == \
        "baseline"

    bed.run(KUSTOMIZE_STEPS[1])
    job = bed.get("job", "gpufence-certs-bootstrap", namespace=NAMESPACE)
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in job["status"]["conditions"]), job["status"]
    secret = bed.get("secret", "gpufence-webhook-tls", namespace=NAMESPACE)
    assert secret["type"] == "kubernetes.io/tls"
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        config = bed.get(kind, "gpufence")
        assert all(hook["clientConfig"].get("caBundle") for hook in config["webhooks"]), f"{kind}: no caBundle"
    deployment = bed.get("deployment", "gpufence-webhook", namespace=NAMESPACE)
    assert deployment["status"].get("availableReplicas") == deployment["spec"]["replicas"] == 2
    for kind, name in (("validatingadmissionpolicy", "gpufence-protect"),
                       ("validatingadmissionpolicybinding", "gpufence-protect-exec"),
                       ("configmap", "gpufence-policy"), ("cronjob", "gpufence-certs-renew")):
        assert bed.get(kind, name, namespace=NAMESPACE) is not None, f"no {kind} {name}"

    bed.run(KUSTOMIZE_STEPS[2])
    ns = bed.get("namespace", USER_NAMESPACE)["metadata"]
    assert ns["labels"]["gpufence.io/injection"] == "enabled"
    assert ns["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert {k: v for k, v in ns["annotations"].items() if k.startswith("gpufence.io/")} == {
        "gpufence.io/default-memory": "25%", "gpufence.io/default-compute": "25",
        "gpufence.io/max-memory": "25%", "gpufence.io/max-compute": "25", "gpufence.io/mode": "enforce"}
    binding = bed.get("rolebinding", "gpufence-enforcer-events", namespace=USER_NAMESPACE)
    assert binding["roleRef"]["name"] == "gpufence-enforcer-events"
    assert binding["subjects"][0]["name"] == f"system:serviceaccounts:{USER_NAMESPACE}"

    output = bed.run(KUSTOMIZE_STEPS[3])
    assert "gpufence-webhook-tls" in output and "1/1" in output, output

    output = bed.run(KUSTOMIZE_STEPS[4])  # the GPU pod is refused while no replica answers
    assert bed.get("deployment", "gpufence-webhook", namespace=NAMESPACE)["spec"]["replicas"] == 2
    assert bed.get("pod", "train", namespace=USER_NAMESPACE) is None

    # An install from before the ValidatingWebhookConfiguration, as the Upgrade section describes it.
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
         "metadata": {"name": "gpufence-guard"},
         "spec": {"failurePolicy": "Fail", "validations": [{"expression": "true"}], "matchConstraints": {
             "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                "resources": ["pods"]}]}}},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
         "metadata": {"name": "gpufence-guard"},
         "spec": {"policyName": "gpufence-guard", "validationActions": ["Deny"]}},
    ]))
    bed.run(KUSTOMIZE_STEPS[5])
    for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
        assert bed.get(kind, "gpufence-guard") is None

    bed.run(KUSTOMIZE_STEPS[6])
    for kind, name in (("mutatingwebhookconfiguration", "gpufence"), ("validatingwebhookconfiguration", "gpufence"),
                       ("validatingadmissionpolicy", "gpufence-protect"),
                       ("validatingadmissionpolicybinding", "gpufence-protect-exec"),
                       ("clusterrole", "gpufence-webhook"), ("priorityclass", "gpufence-webhook")):
        assert bed.get(kind, name) is None, f"{kind} {name} is left after the uninstall"
    ns = bed.get("namespace", USER_NAMESPACE)["metadata"]
    assert not [k for k in ns.get("labels", {}) if k.startswith("gpufence.io/")], ns
    assert not [k for k in ns.get("annotations", {}) if k.startswith("gpufence.io/")], ns
    assert bed.get("rolebinding", "gpufence-enforcer-events", namespace=USER_NAMESPACE) is None
    bed.wait_uninstalled()


# ---------------------------------------------------------------------------------------------
# The Helm blocks, each from a cluster without gpufence, uninstalled after.


def _helm_release(bed: Bed) -> dict[str, Any]:
    result = subprocess.run([str(bed.helm), "status", "gpufence", "-o", "json"], env=bed.env, capture_output=True,
                            text=True, timeout=60, check=True)
    return json.loads(result.stdout)


def _helm_uninstall(bed: Bed) -> None:
    subprocess.run([str(bed.helm), "uninstall", "gpufence"], env=bed.env, capture_output=True, text=True,
                   timeout=120, check=True)
    bed.wait_uninstalled()


def _runs_the_image(bed: Bed) -> None:
    deployment = bed.get("deployment", "gpufence-webhook", namespace=NAMESPACE)
    assert {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]} == {IMAGE}
    policy = bed.get("configmap", "gpufence-policy", namespace=NAMESPACE)
    assert policy["data"]["sidecar-image"] == IMAGE


def test_helm_block_pointing_at_your_image(bed: Bed) -> None:
    bed.start_clean()
    bed.run(HELM_STEPS[0])
    try:
        assert _helm_release(bed)["info"]["status"] == "deployed"
        _runs_the_image(bed)
    finally:
        _helm_uninstall(bed)


def test_helm_install_block_with_monitoring(bed: Bed) -> None:
    bed.start_clean()
    # The prerequisite the doc names for monitoring: the Prometheus Operator's CRDs.
    try:
        crds = crd_files("prometheus-operator")
    except GoMissing as exc:
        missing(f"cannot fetch the Prometheus Operator CRDs: {exc}")
    for crd in crds:
        bed.cp.kubectl("apply", "--server-side", "-f", str(crd))
    kube.wait_for(lambda: all(
        any(c["type"] == "Established" and c["status"] == "True" for c in crd.get("status", {}).get("conditions") or [])
        for crd in bed.get("crd")["items"]), "the CRDs to be established")
    bed.run(HELM_STEPS[1])
    try:
        assert _helm_release(bed)["info"]["status"] == "deployed"
        _runs_the_image(bed)
        assert bed.get("podmonitor", "-A")["items"], "monitoring.enabled=true rendered no PodMonitor"
        job = bed.get("job", "gpufence-certs-bootstrap", namespace=NAMESPACE)
        assert any(c["type"] == "Complete" for c in job["status"]["conditions"]), job["status"]
    finally:
        _helm_uninstall(bed)
