"""Device access without a device request (issue 32 row 4): privileged containers and hostPath volumes
that reach the node's devices are refused in opted-in namespaces, unless the admin allows them."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from gpufence.contract import INJECTION_ENABLED, INJECTION_LABEL
from gpufence.webhook.client import pod_admission_review
from gpufence.webhook.core.admission import review
from gpufence.webhook.core.device_access import device_access_denial, reaches_devices
from gpufence.webhook.core.settings import InjectionSettings, NamespaceInfo
from gpufence.webhook.core.sidecar import pod_volumes

ADMINS = ("system:masters", "gpufence:admins")


@pytest.mark.parametrize("path", [
    "/", "/dev", "/dev/", "/dev/nvidia0", "//dev//nvidia-caps", "/dev/./nvidiactl", "/proc", "/proc/driver/nvidia",
    "/sys/bus/pci/devices", "/run", "/run/nvidia", "/run/nvidia/driver", "/var/run/nvidia", "/var", "/usr",
    "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64", "/lib64",
    # issue 38 row 3: the memory filesystems pass exactly, not what lies under them (a symlink another
    # pod can leave there), and /dev's device directories stay refused
    "/dev/shm/d", "/dev/hugepages/x/y", "/dev/mqueue/q", "/dev/char", "/dev/char/195:0", "/dev/nvidia-caps",
    "/dev/dri", "/dev/shmx",
])
def test_paths_that_reach_the_devices_or_the_driver(path: str) -> None:
    assert reaches_devices(path)


@pytest.mark.parametrize("path", [
    "/var/cache/models", "/data", "/devices", "/dev-cache", "/run/nvidia-persistenced-not", "/usr/local/lib/libvgpu.so",
    "/opt", "/home/user", "/processes", "relative/dev",
    "/dev/shm", "/dev/shm/", "//dev//hugepages", "/dev/mqueue/.",
])
def test_paths_that_do_not(path: str) -> None:
    assert not reaches_devices(path)


def spec(**extra: Any) -> dict[str, Any]:
    return {"containers": [{"name": "c", "image": "i"}], **extra}


def test_privileged_containers_are_denied_naming_the_field() -> None:
    for key in ("initContainers", "containers"):
        pod = spec(**{key: [{"name": "ok", "image": "i"}, {"name": "p", "image": "i",
                                                             "securityContext": {"privileged": True}}]})
        denial = device_access_denial(pod, "team", [], ADMINS, ())
        assert denial is not None and f"spec.{key}[1].securityContext.privileged" in denial
        assert '"team"' in denial and "device-access-namespaces" in denial and 'resources.limits["' in denial
    assert device_access_denial(spec(containers=[{"name": "c", "securityContext": {"privileged": False}}]),
                                "team", [], ADMINS, ()) is None


def test_device_volumes_are_denied_and_other_volumes_are_not() -> None:
    device = spec(volumes=[{"name": "x", "emptyDir": {}}, {"name": "d", "hostPath": {"path": "/opt/gpu0",
                                                                                     "type": "CharDevice"}}])
    denial = device_access_denial(device, "team", [], ADMINS, ())
    assert denial is not None and "spec.volumes[1].hostPath.type" in denial and "CharDevice" in denial
    nvidia = spec(volumes=[{"name": "n", "hostPath": {"path": "/dev/nvidia0"}}])
    assert "spec.volumes[0].hostPath.path" in (device_access_denial(nvidia, "team", [], ADMINS, ()) or "")
    harmless = spec(volumes=[{"name": "m", "hostPath": {"path": "/var/cache/models"}}, {"name": "e", "emptyDir": {}}])
    assert device_access_denial(harmless, "team", [], ADMINS, ()) is None


def test_the_admins_exemptions() -> None:
    pod = spec(containers=[{"name": "c", "securityContext": {"privileged": True}}],
               volumes=[{"name": "d", "hostPath": {"path": "/dev"}}])
    assert device_access_denial(pod, "tools", [], ADMINS, ("tools",)) is None
    assert device_access_denial(pod, "team", ["system:authenticated", "gpufence:admins"], ADMINS, ()) is None
    assert device_access_denial(pod, "team", ["system:authenticated"], ADMINS, ("tools",)) is not None


def test_gpufences_own_volumes_pass_only_as_gpufence_makes_them() -> None:
    settings = InjectionSettings(mount_host_proc=True, preload_library_host_path="/usr/lib64/libvgpu.so")
    ours = pod_volumes(settings)
    pod = spec(volumes=ours)
    assert device_access_denial(pod, "team", [], ADMINS, (), ours) is None
    assert device_access_denial(pod, "team", [], ADMINS, ()) is not None  # a pod without a GPU: not ours
    changed = [{**v, "hostPath": {**v["hostPath"], "type": "DirectoryOrCreate"}} if "hostPath" in v else v
               for v in ours]
    assert device_access_denial(spec(volumes=changed), "team", [], ADMINS, (), ours) is not None


def test_garbage_is_tolerated() -> None:
    for pod in (None, [], {"containers": "x"}, {"containers": [None, 1]}, {"volumes": [None, {"hostPath": 1}]},
                {"volumes": [{"hostPath": {"path": 7}}]}):
        assert device_access_denial(pod, "team", None, ADMINS, ()) is None


DEFAULT = InjectionSettings()


def _review(pod_spec: dict[str, Any], groups: list[str], settings: InjectionSettings = DEFAULT) -> Any:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team",
                                                          "labels": {"gpufence.io/inject": "false"}},
           "spec": pod_spec}
    payload = pod_admission_review(pod, uid="u", namespace="team")
    payload["request"]["userInfo"]["groups"] = groups

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name, labels={INJECTION_LABEL: INJECTION_ENABLED},
                                 annotations={"gpufence.io/allow-opt-out": "true"})

    return review(payload, settings, Lookup())


def test_the_review_denies_opted_out_pods_too_and_exempts_admins() -> None:
    """Opting out of the sidecar does not opt out of the node's devices: the GPUs are other pods' too."""
    privileged = spec(containers=[{"name": "c", "image": "i", "securityContext": {"privileged": True}}])
    assert _review(privileged, ["system:authenticated"]).outcome == "denied"
    assert _review(privileged, ["system:authenticated"], InjectionSettings(void_non_gpu_containers=False)
                   ).outcome == "denied"
    # An admin's pod is admitted, with the webhook's record of its creator (for the node guardian).
    by_admin = _review(privileged, ["gpufence:admins"])
    assert by_admin.outcome == "mutated" and _patch(by_admin) == [
        {"op": "add", "path": "/metadata/annotations",
         "value": {"gpufence.io/admin-device-access": "system:serviceaccount:kube-system:replicaset-controller"}}]
    assert _review(privileged, [], InjectionSettings(device_access_namespaces=("team",))).outcome == "skipped"


def _patch(result: Any) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(result.review["response"]["patch"]))


def _pod_review(metadata: dict[str, Any], containers: list[dict[str, Any]], groups: list[str],
                username: str = "alice") -> Any:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "team", **metadata},
           "spec": {"containers": containers}}
    payload = pod_admission_review(pod, uid="u", namespace="team", username=username)
    payload["request"]["userInfo"]["groups"] = groups

    class Lookup:
        def get(self, name: str) -> NamespaceInfo:
            return NamespaceInfo(name, labels={INJECTION_LABEL: INJECTION_ENABLED})

    return review(payload, DEFAULT, Lookup())


PLAIN = [{"name": "c", "image": "i", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]}]
GPU = [{"name": "train", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]
PRIVILEGED = [{"name": "c", "image": "i", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
               "securityContext": {"privileged": True}}]
RECORD = "gpufence.io/admin-device-access"


@pytest.mark.parametrize("containers", [PLAIN, GPU], ids=["plain", "gpu"])
def test_the_admin_device_access_record_is_the_webhooks_alone(containers: list[dict[str, Any]]) -> None:
    denied = _pod_review({"annotations": {RECORD: "alice"}}, containers, ["system:authenticated"])
    assert denied.outcome == "denied"
    message = denied.review["response"]["status"]["message"]
    assert message.startswith(f'annotation {RECORD}="alice" (metadata.annotations): ')
    assert "admin-groups" in message and "remove it" in message
    # Anyone else's pod gets no record.
    tenant = _pod_review({}, containers, ["system:authenticated"])
    assert RECORD not in json.dumps(_patch(tenant) if tenant.outcome == "mutated" else [])


def test_an_admins_pod_is_recorded_where_it_has_what_only_admins_may_grant() -> None:
    # Device access only an admin may grant (privileged): recorded with the user's name, whatever
    # the pod said, before the injection's own operations; a pod that already says so is left as is.
    privileged = _pod_review({}, PRIVILEGED, ["system:masters"])
    assert privileged.outcome == "mutated" and _patch(privileged) == [
        {"op": "add", "path": "/metadata/annotations", "value": {RECORD: "alice"}}]
    renamed = _pod_review({"annotations": {RECORD: "someone"}}, PRIVILEGED, ["gpufence:admins"])
    assert _patch(renamed) == [{"op": "replace", "path": "/metadata/annotations/gpufence.io~1admin-device-access",
                                "value": "alice"}]
    assert _pod_review({"annotations": {RECORD: "alice"}}, PRIVILEGED, ["system:masters"]).outcome == "unchanged"
    # An annotation that hands out devices, on a GPU pod: the record comes first, then the injection.
    nri = _pod_review({"annotations": {"nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0"}}, GPU, ["gpufence:admins"])
    ops = _patch(nri)
    assert ops[0] == {"op": "add", "path": "/metadata/annotations/gpufence.io~1admin-device-access", "value": "alice"}
    assert len(ops) > 1  # the sidecar and the rest
    # An admin's pod that needed no exemption gets no record: the admin allowed it no device.
    for containers in (PLAIN, GPU):
        plain = _pod_review({}, containers, ["system:masters"])
        assert RECORD not in json.dumps(_patch(plain) if plain.outcome == "mutated" else [])


def test_memory_filesystems_pass_but_not_as_device_types() -> None:
    """Issue 38 row 3: an MPI/NCCL worker's hostPath /dev/shm (tmpfs) is no device access."""
    shm = spec(volumes=[{"name": "dshm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
                        {"name": "huge", "hostPath": {"path": "/dev/hugepages"}},
                        {"name": "mq", "hostPath": {"path": "/dev/mqueue"}}])
    assert device_access_denial(shm, "team", [], ADMINS, ()) is None
    char = spec(volumes=[{"name": "dshm", "hostPath": {"path": "/dev/shm", "type": "CharDevice"}}])
    assert "spec.volumes[0].hostPath.type" in (device_access_denial(char, "team", [], ADMINS, ()) or "")


@pytest.mark.parametrize("target", [
    "/var/run/nvidia-container-devices/all", "/var/run/nvidia-container-devices",
    "//var/run/x/../nvidia-container-devices/GPU-0", "/var/run/nvidia-container-devicesX",
])
def test_mounts_the_toolkit_reads_as_gpu_requests_are_denied(target: str) -> None:
    """Whatever the volume: a hostPath of a symlink the node has to /dev/null is not seen here."""
    pod = spec(containers=[{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/data"},
                                                          {"name": "v", "mountPath": target}]}],
               volumes=[{"name": "v", "hostPath": {"path": "/usr/lib/systemd/system/ctrl-alt-del.target"}}])
    denial = device_access_denial(pod, "team", [], ADMINS, ())
    assert denial is not None and "spec.containers[0].volumeMounts[1].mountPath" in denial
    assert device_access_denial(pod, "team", ["gpufence:admins"], ADMINS, ()) is None
    fine = spec(containers=[{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/var/run/nvidia"}]}])
    assert device_access_denial(fine, "team", [], ADMINS, ()) is None


def test_the_verify_step_passes_an_admins_recorded_pod_and_refuses_it_from_anyone_else() -> None:
    import jsonpatch

    from gpufence.webhook.core.admission import verify

    admin = _pod_review({"annotations": {"nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0"}}, GPU, ["gpufence:admins"])
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "namespace": "team", "annotations": {"nvidia.cdi.k8s.io/pod": "nvidia.com/gpu=0"}},
           "spec": {"containers": GPU}}
    final = jsonpatch.apply_patch(pod, _patch(admin))
    assert final["metadata"]["annotations"][RECORD] == "alice"

    def verified(pod: dict[str, Any], groups: list[str]) -> Any:
        payload = pod_admission_review(pod, uid="u", namespace="team", username="alice")
        payload["request"]["userInfo"]["groups"] = groups

        class Lookup:
            def get(self, name: str) -> NamespaceInfo:
                return NamespaceInfo(name, labels={INJECTION_LABEL: INJECTION_ENABLED})

        return verify(payload, DEFAULT, Lookup())

    assert verified(final, ["gpufence:admins"]).outcome == "verified"
    # The record on a tenant's pod, whatever put it there after gpufence's webhook: refused.
    tenants = copy.deepcopy(final)
    del tenants["metadata"]["annotations"]["nvidia.cdi.k8s.io/pod"]
    refused = verified(tenants, ["system:authenticated"])
    assert refused.outcome == "refused"
    assert f"annotation {RECORD}=" in refused.review["response"]["status"]["message"]
