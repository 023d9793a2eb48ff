"""``gpufence-webhook`` flags, env vars, JSON logs, and the real process outside a cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from gpufence.logs import JsonFormatter
from gpufence.webhook.cli import FLAGS, parse_args, settings_from_args
from gpufence.webhook.core.settings import InjectionSettings
from tests.support.tlsutil import LocalPKI, pod_review

REPO = Path(__file__).resolve().parents[3]
TLS = ["--tls-cert-file", "c.crt", "--tls-private-key-file", "c.key"]


def test_defaults_match_injection_settings():
    args = parse_args(TLS, environ={})
    assert (args.port, args.bind_address, args.cert_reload_interval, args.log_level) == (8443, "0.0.0.0", 1.0, "info")
    assert settings_from_args(args) == InjectionSettings()


# A non-default value for every InjectionSettings field, as flags.
EVERY_FIELD = [
    "--sidecar-image=img:2", "--sidecar-image-pull-policy=Always",
    "--gpu-resource-name=nvidia.com/gpu", "--gpu-resource-name=nvidia.com/mig-1g.10gb",
    "--sidecar-mode=container", "--metrics-port=9500", "--sidecar-cpu-request=20m",
    "--sidecar-memory-request=96Mi", "--sidecar-memory-limit=384Mi", "--default-memory=25%",
    "--default-compute=50", "--default-grace-period=30s", "--poll-interval=250ms",
    "--nvidia-visible-devices=void", "--nvidia-driver-capabilities=utility,compute", "--mount-host-proc",
    "--host-proc-mount-path=/hp", "--mps-limits=true", "--preload-library=/opt/libvgpu.so",
    "--preload-library-mount-dir=/pre", "--max-memory=40Gi", "--max-compute=25", "--default-mode=audit",
    "--allow-audit", "--allow-opt-out=true", "--sidecar-cpu-limit=1", "--void-non-gpu-containers=false",
    "--gpu-memory=nvidia.com/gpu=80Gi", "--gpu-memory=nvidia.com/mig-1g.10gb=10Gi",
    "--pytorch-memory-fraction", "--framework-memory-headroom=1Gi",
    "--exclusive-gpu-resource-name=nvidia.com/mig-3g.*", "--non-gpu-resource-claims=nic",
    "--admin-groups=ops:gpu", "--driver-memory-limits=on", "--kai-scheduler-name=team-kai",
    "--dra-gpu-driver-name=gpu.example.com", "--device-access-namespaces=gpu-tools",
    "--other-namespace-gpu-processes=terminate", "--host-gpu-processes=report",
]


def test_every_settings_field_has_a_flag():
    settings = settings_from_args(parse_args(TLS + EVERY_FIELD, environ={}))
    defaults = InjectionSettings()
    unchanged = [f.name for f in dataclasses.fields(InjectionSettings)
                 if getattr(settings, f.name) == getattr(defaults, f.name)]
    assert unchanged == []
    assert settings.gpu_resource_names == ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb")
    assert settings.exclusive_gpu_resource_names == ("nvidia.com/mig-3g.*",)
    assert settings.non_gpu_resource_claims == ("nic",)
    assert settings.kai_scheduler_names == ("team-kai",)
    assert settings.dra_gpu_drivers == ("gpu.example.com",)
    assert settings.device_access_namespaces == ("gpu-tools",)
    assert settings.native_sidecar is False and settings.mount_host_proc is True
    assert (settings.default_grace_period_seconds, settings.poll_interval_seconds) == (30.0, 0.25)
    assert settings.gpu_memory == (("nvidia.com/gpu", 80 << 30), ("nvidia.com/mig-1g.10gb", 10 << 30))
    assert settings.framework_memory_headroom_bytes == 1 << 30
    assert (str(settings.other_namespace_gpu_processes), str(settings.host_gpu_processes)) == ("terminate", "report")


@pytest.mark.parametrize(("value", "reason"), [
    ("80Gi", "RESOURCE=QUANTITY"), ("nvidia.com/gpu=lots", "is not a quantity"),
    ("nvidia.com/gpu=512Mi", "at least 1Gi"), ("=80Gi", "RESOURCE=QUANTITY"),
])
def test_bad_gpu_memory_is_refused(value: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([*TLS, f"--gpu-memory={value}"], environ={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-memory" in err and reason in err


def test_gpu_memory_from_env_is_comma_separated() -> None:
    args = parse_args(TLS, environ={"GPUFENCE_WEBHOOK_GPU_MEMORY": "nvidia.com/gpu=80Gi, nvidia.com/gpu.shared=40Gi"})
    assert settings_from_args(args).gpu_memory == (("nvidia.com/gpu", 80 << 30), ("nvidia.com/gpu.shared", 40 << 30))


def test_env_vars_and_flag_precedence():
    environ = {
        "GPUFENCE_WEBHOOK_TLS_CERT_FILE": "/certs/tls.crt",
        "GPUFENCE_WEBHOOK_TLS_PRIVATE_KEY_FILE": "/certs/tls.key",
        "GPUFENCE_WEBHOOK_PORT": "9443",
        "GPUFENCE_WEBHOOK_GPU_RESOURCE_NAME": "nvidia.com/gpu, example.com/gpu",
        "GPUFENCE_WEBHOOK_MOUNT_HOST_PROC": "true",
        "GPUFENCE_WEBHOOK_CERT_RELOAD_INTERVAL": "2s",
        "GPUFENCE_WEBHOOK_SIDECAR_MODE": "container",
    }
    args = parse_args(["--port", "10443"], environ=environ)
    assert args.port == 10443  # the flag wins
    assert args.tls_cert_file == "/certs/tls.crt" and args.cert_reload_interval == 2.0
    settings = settings_from_args(args)
    assert settings.gpu_resource_names == ("nvidia.com/gpu", "example.com/gpu")
    assert settings.mount_host_proc is True and settings.native_sidecar is False
    assert parse_args(["--mount-host-proc=false"], environ=environ).sidecar_mount_host_proc is False
    assert all(flag.env.startswith("GPUFENCE_WEBHOOK_") for flag in FLAGS)


@pytest.mark.parametrize(("argv", "environ", "needle"), [
    (["--port", "70000"], {}, "--port"),
    (["--port", "x"], {}, "not a port number"),
    (["--sidecar-mode", "sidecar"], {}, "native, container"),
    (["--default-memory", "1E999999999"], {}, "--default-memory"),
    (["--default-memory", "500m"], {}, "--default-memory"),
    (["--sidecar-cpu-request", "lots"], {}, "--sidecar-cpu-request"),
    (["--sidecar-memory-limit", "-1Gi"], {}, "--sidecar-memory-limit"),
    (["--sidecar-cpu-limit", "0"], {}, "--sidecar-cpu-limit"),
    (["--default-compute", "150"], {}, "--default-compute"),
    (["--poll-interval", "1ms"], {}, "between"),
    (["--mps-limits=maybe"], {}, '"true" or "false"'),
    (["--sidecar-image-pull-policy", "Sometimes"], {}, "IfNotPresent"),
    (["--no-such-flag"], {}, "unrecognized"),
    ([], {"GPUFENCE_WEBHOOK_METRICS_PORT": "abc"}, "GPUFENCE_WEBHOOK_METRICS_PORT"),
])
def test_bad_values_exit_2_with_a_message(argv: list[str], environ: dict[str, str], needle: str,
                                          capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        parse_args(TLS + argv, environ=environ)
    assert exited.value.code == 2
    assert needle in capsys.readouterr().err


def test_certificate_flags_are_required(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        parse_args([], environ={})
    assert exited.value.code == 2 and "--tls-cert-file" in capsys.readouterr().err


def test_json_log_lines():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("webhook.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    record.port = 8443
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "failed here" and entry["level"] == "error" and entry["port"] == 8443
    assert entry["event"] == "log" and entry["logger"] == "webhook.x"
    assert "ValueError: boom" in entry["exception"] and entry["time"].endswith("Z")


def outside_cluster_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "GPUFENCE_"))}
    env.update(KUBECONFIG=str(tmp_path / "no-kubeconfig"), HOME=str(tmp_path), PYTHONPATH=str(REPO))
    return env


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
async def test_process_serves_outside_a_cluster_and_stops_on_sigterm(pki: LocalPKI, tmp_path: Path, event_loop: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufence.webhook", "--port=0", "--bind-address=127.0.0.1", "--shutdown-delay=2s",
        f"--tls-cert-file={pki.volume.cert_file}", f"--tls-private-key-file={pki.volume.key_file}",
        f"--event-loop={event_loop}", env=outside_cluster_env(tmp_path), cwd=REPO, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[dict] = []
    try:
        async with asyncio.timeout(20):
            while not any(entry["event"] == "serving" for entry in lines):
                raw = await proc.stderr.readline()
                assert raw, f"process exited early: {lines}"
                lines.append(json.loads(raw))  # every line is one JSON object
        port = next(entry["port"] for entry in lines if entry["event"] == "serving")
        assert next(entry["event_loop"] for entry in lines if entry["event"] == "serving") == event_loop
        assert any("namespace defaults are off" in entry.get("message", "") for entry in lines)

        connector = aiohttp.TCPConnector(ssl=pki.client_context())
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(f"https://localhost:{port}/readyz") as resp:
                assert resp.status == 200
            async with session.post(f"https://localhost:{port}/mutate", json=pod_review()) as resp:
                assert resp.status == 200 and "patch" in (await resp.json())["response"]

            # SIGTERM: during the shutdown delay /readyz fails (endpoints drop the replica) while
            # reviews are still answered (the API server may still pick it until they do).
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(20):
                while (raw := await proc.stderr.readline()) and json.loads(raw)["event"] != "draining":
                    pass
            assert raw, "the process exited without draining"
            async with session.get(f"https://localhost:{port}/readyz") as resp:
                assert resp.status == 503 and "shutting down" in (await resp.json())["reasons"]
            async with session.post(f"https://localhost:{port}/mutate", json=pod_review()) as resp:
                assert resp.status == 200 and "patch" in (await resp.json())["response"]

        async with asyncio.timeout(20):
            rest = await proc.stderr.read()
            assert await proc.wait() == 0
        events = [json.loads(line)["event"] for line in rest.decode().splitlines()]
        assert "shutting_down" in events and "stopped" in events
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _without_uvloop(tmp_path: Path) -> dict[str, str]:
    """The environment of a platform where uvloop cannot be imported (no wheel for it)."""
    shadow = tmp_path / "no-uvloop"
    shadow.mkdir()
    (shadow / "uvloop.py").write_text('raise ImportError("no uvloop wheel for this platform")\n')
    env = outside_cluster_env(tmp_path)
    env["PYTHONPATH"] = f"{shadow}:{env['PYTHONPATH']}"
    return env


async def test_without_uvloop_auto_serves_on_asyncio_and_uvloop_refuses_to_start(pki: LocalPKI, tmp_path: Path):
    env = _without_uvloop(tmp_path)
    tls = (f"--tls-cert-file={pki.volume.cert_file}", f"--tls-private-key-file={pki.volume.key_file}")
    refused = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufence.webhook", "--port=0", "--bind-address=127.0.0.1", *tls,
        "--event-loop=uvloop", env=env, cwd=REPO, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(refused.communicate(), 20)
    assert refused.returncode == 1
    failed = [json.loads(line) for line in err.decode().splitlines() if '"startup_failed"' in line]
    assert failed and "--event-loop uvloop: uvloop cannot be imported" in failed[0]["error"], err
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufence.webhook", "--port=0", "--bind-address=127.0.0.1", "--shutdown-delay=0",
        *tls, env=env, cwd=REPO, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(20):
            while (raw := await proc.stderr.readline()) and json.loads(raw)["event"] != "serving":
                pass
        assert raw, "the process exited before serving"
        assert json.loads(raw)["event_loop"] == "asyncio"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_process_rejects_a_bad_flag(tmp_path: Path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufence.webhook", "--sidecar-mode=sidecar", *TLS,
        env=outside_cluster_env(tmp_path), cwd=REPO, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2
    assert b"--sidecar-mode" in err and b"native, container" in err


@pytest.mark.parametrize(
    ("flag", "given", "stored"),
    [
        ("--sidecar-memory-limit", "1024Mi", "1Gi"),
        ("--sidecar-memory-request", "0.5Gi", "512Mi"),
        ("--sidecar-cpu-request", "0.5", "500m"),
        ("--sidecar-cpu-limit", "2000m", "2"),
        ("--sidecar-cpu-limit", "none", None),
    ],
)
def test_sidecar_resources_are_written_as_the_api_server_stores_them(flag: str, given: str, stored: str | None) -> None:
    """The API server canonicalises quantities; a non-canonical flag would make every reinvocation patch."""
    settings = settings_from_args(parse_args([*TLS, f"{flag}={given}"], environ={}))
    field = flag.removeprefix("--").replace("-", "_")
    assert getattr(settings, field) == stored


# --- --policy-configmap: the policy from the ConfigMap, never also from flags ---------------------------


POLICY = ["--policy-configmap", "gpufence/gpufence-policy"]


def test_policy_configmap_alone_is_accepted() -> None:
    args = parse_args(TLS + POLICY + ["--port", "9443", "--log-level", "debug"], environ={})
    assert args.policy_configmap == ("gpufence", "gpufence-policy") and args.port == 9443
    assert parse_args(TLS, environ={"GPUFENCE_WEBHOOK_POLICY_CONFIGMAP": "ns/p"}).policy_configmap == ("ns", "p")
    assert parse_args(TLS, environ={}).policy_configmap is None  # the local override: flags alone


@pytest.mark.parametrize(("argv", "environ", "named", "key"), [
    (["--max-memory=40Gi"], {}, "--max-memory", 'max-memory: "40Gi"'),
    (["--poll-interval=1s"], {}, "--sidecar-poll-interval", 'sidecar-poll-interval: "1s"'),  # the old name too
    (["--gpu-resource-name=a/b", "--gpu-resource-name=c/d"], {}, "--gpu-resource-name", 'gpu-resource-name: "a/b,c/d"'),
    ([], {"GPUFENCE_WEBHOOK_ALLOW_OPT_OUT": "true"}, "GPUFENCE_WEBHOOK_ALLOW_OPT_OUT", 'allow-opt-out: "true"'),
    ([], {"GPUFENCE_WEBHOOK_SIDECAR_IMAGE": "img:1"}, "GPUFENCE_WEBHOOK_SIDECAR_IMAGE", 'sidecar-image: "img:1"'),
])
def test_policy_configmap_with_a_policy_flag_refuses_to_start(argv: list[str], environ: dict[str, str], named: str,
                                                               key: str, capsys: pytest.CaptureFixture[str]) -> None:
    """One source of each setting: a flag on top of the ConfigMap would be a second one."""
    with pytest.raises(SystemExit) as exited:
        parse_args(TLS + POLICY + argv, environ=environ)
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--policy-configmap gpufence/gpufence-policy" in err and named in err and key in err
    assert "the one source of the policy" in err and "leave out --policy-configmap" in err


def test_an_empty_policy_env_var_is_not_a_flag() -> None:
    """As everywhere else, an empty GPUFENCE_WEBHOOK_* variable means unset."""
    assert parse_args(TLS + POLICY, environ={"GPUFENCE_WEBHOOK_MAX_MEMORY": ""}).max_memory is None


@pytest.mark.parametrize("value", ["gpufence", "Gpufence/policy", "gpufence/", "/gpufence-policy", "a/b/c"])
def test_bad_policy_configmap_names_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([*TLS, f"--policy-configmap={value}"], environ={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--policy-configmap" in err and "NAMESPACE/NAME" in err and "gpufence/gpufence-policy" in err


async def test_policy_configmap_without_a_cluster_fails_with_a_clear_message(pki: LocalPKI, tmp_path: Path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpufence.webhook", "--port=0", "--bind-address=127.0.0.1", *POLICY,
        f"--tls-cert-file={pki.volume.cert_file}", f"--tls-private-key-file={pki.volume.key_file}",
        env=outside_cluster_env(tmp_path), cwd=REPO, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 1
    (failed,) = [entry for entry in map(json.loads, err.decode().splitlines()) if entry["event"] == "startup_failed"]
    assert "--policy-configmap gpufence/gpufence-policy needs the Kubernetes API" in failed["error"]
    assert "--kubeconfig" in failed["error"]
