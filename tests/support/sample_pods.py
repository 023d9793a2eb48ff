"""Sample pods and AdmissionReviews shared by the tests and the benchmarks: a small GPU pod, a
typical training pod as a Job controller creates it, a huge one, a denied and a plain (non-GPU) one,
and the mixed traffic of the load generator."""

from __future__ import annotations

import json
from typing import Any


def admission_review(pod: dict[str, Any], uid: str = "00000000-0000-0000-0000-000000000001",
                     namespace: str = "team-a", operation: str = "CREATE") -> dict[str, Any]:
    from gpufence.webhook.client import pod_admission_review

    return pod_admission_review(pod, uid=uid, namespace=namespace, operation=operation)


def small_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "cuda", "namespace": "team-a", "annotations": {"gpufence.io/memory": "8Gi"}},
        "spec": {"containers": [{"name": "cuda", "image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


def typical_pod() -> dict[str, Any]:
    """A training pod as a Job controller would create it: 3 containers, 30 env vars, volumes."""

    def env(prefix: str, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"name": f"{prefix}_VAR_{i}", "value": f"value-{i}-" + "x" * 24} for i in range(n)]
        out.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}})
        return out

    def container(name: str, gpu: bool, n_env: int) -> dict[str, Any]:
        resources: dict[str, Any] = {"requests": {"cpu": "4", "memory": "32Gi"},
                                     "limits": {"cpu": "8", "memory": "64Gi"}}
        if gpu:
            resources["limits"]["nvidia.com/gpu"] = "1"
        return {
            "name": name, "image": f"registry.example.com/ml/{name}:2024.06.1",
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-m", f"ml.{name}"], "args": ["--config", "/etc/train/config.yaml", "--epochs", "90"],
            "env": env(name.upper(), n_env),
            "resources": resources,
            "ports": [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
            "volumeMounts": [
                {"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "config", "mountPath": "/etc/train"},
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                 "readOnly": True},
            ],
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }

    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": "resnet-train-", "namespace": "team-a",
            "labels": {"app": "resnet", "job-name": "resnet-train", "controller-uid": "6c1f3a8e-8f0e"},
            "annotations": {"gpufence.io/memory": "20Gi", "gpufence.io/memory.eval": "10%",
                            "gpufence.io/compute": "50", "gpufence.io/grace-period": "30",
                            "prometheus.io/scrape": "true"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "resnet-train",
                                 "uid": "6c1f3a8e-8f0e", "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "restartPolicy": "Never", "serviceAccountName": "trainer", "schedulerName": "default-scheduler",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "containers": [container("train", True, 10), container("eval", True, 10), container("logger", False, 8)],
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet"}},
                {"name": "config", "configMap": {"name": "resnet-config"}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {"name": "kube-api-access-abcde", "projected": {"sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}},
            ],
        },
    }


def huge_pod(target_bytes: int = 1 << 20) -> dict[str, Any]:
    """A GPU pod of about ``target_bytes`` of JSON: a large annotation plus many env vars."""
    pod = typical_pod()
    pod["metadata"]["annotations"]["example.com/blob"] = "a" * (target_bytes // 2)
    per = 64
    n = (target_bytes // 2) // (per + 30)
    pod["spec"]["containers"][0]["env"] += [{"name": f"BULK_{i}", "value": "v" * per} for i in range(n)]
    return pod


def denied_pod() -> dict[str, Any]:
    pod = small_pod()
    pod["metadata"]["annotations"]["gpufence.io/memory"] = "lots"
    return pod


def plain_pod() -> dict[str, Any]:
    pod = small_pod()
    del pod["spec"]["containers"][0]["resources"]
    return pod


def mixed_bodies() -> list[tuple[str, bytes]]:
    """(kind, body) for mixed traffic: mutated, denied, skipped, 400 malformed JSON, 400 wrong envelope."""
    wrong = admission_review(small_pod())
    wrong["apiVersion"] = "admission.k8s.io/v1beta1"
    return [
        ("typical", json.dumps(admission_review(typical_pod())).encode()),
        ("small", json.dumps(admission_review(small_pod())).encode()),
        ("denied", json.dumps(admission_review(denied_pod())).encode()),
        ("skipped", json.dumps(admission_review(plain_pod())).encode()),
        ("bad-json", b'{"apiVersion": "admission.k8s.io/v1", "kind": '),
        ("bad-envelope", json.dumps(wrong).encode()),
    ]
