"""--help of the CLIs is their reference: every option explained, defaults shown as one writes them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpufence.certs.cli import build_parser as certs_parser
from gpufence.webhook.cli import FLAGS, parse_args, settings_from_args
from gpufence.webhook.cli import build_parser as webhook_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("command", ["generate", "bootstrap", "inspect"])
def test_every_certs_option_has_help_and_its_default(command: str) -> None:
    sub = _subparsers(certs_parser())[command]
    text = sub.format_help()
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings} has no help text"
        if action.default not in (None, [], False) and not action.required:
            assert f"(default: {action.default})" in " ".join(text.split()), (command, action.option_strings)


def test_certs_help_shows_real_defaults() -> None:
    text = " ".join(_subparsers(certs_parser())["bootstrap"].format_help().split())
    assert "(default: 30)" in text and "(default: gpufence-webhook-tls)" in text and "(default: None)" not in text


def test_webhook_help_shows_durations_as_written() -> None:
    text = " ".join(webhook_parser().format_help().split())
    assert "default 5s]" in text  # --shutdown-delay
    assert "default 500ms]" in text  # --poll-interval
    assert "default 10s]" in text  # --default-grace-period
    assert not [f.name for f in FLAGS if f"default {f.default}]" in text and isinstance(f.default, float)]
    assert "default none]" not in text.split("--gpu-resource-name", 1)[1].split("--", 1)[0]


# --- webhook flags renamed to say they configure the sidecar, old names kept for one release ---------


def test_renamed_flags_say_what_they_set() -> None:
    renamed = {f.deprecated: f.name for f in FLAGS if f.deprecated}
    assert renamed == {
        "metrics-port": "sidecar-metrics-port", "poll-interval": "sidecar-poll-interval",
        "nvidia-visible-devices": "sidecar-nvidia-visible-devices",
        "nvidia-driver-capabilities": "sidecar-nvidia-driver-capabilities",
        "mount-host-proc": "sidecar-mount-host-proc", "host-proc-mount-path": "sidecar-host-proc-mount-path",
    }
    text = " ".join(webhook_parser().format_help().split())
    assert "(formerly --poll-interval, deprecated)" in text
    assert "--poll-interval VALUE" not in text  # the old name is accepted, not advertised


REQUIRED = ["--tls-cert-file=/c", "--tls-private-key-file=/k"]


@pytest.mark.parametrize(("argv", "environ"), [
    (["--sidecar-poll-interval=2s"], {}),
    (["--poll-interval=2s"], {}),
    ([], {"GPUFENCE_WEBHOOK_SIDECAR_POLL_INTERVAL": "2s"}),
    ([], {"GPUFENCE_WEBHOOK_POLL_INTERVAL": "2s"}),
])
def test_old_and_new_names_set_the_same_thing(argv: list[str], environ: dict[str, str]) -> None:
    args = parse_args([*REQUIRED, *argv], environ=environ)
    assert settings_from_args(args).poll_interval_seconds == 2.0
    old = any("POLL_INTERVAL" in k and "SIDECAR" not in k for k in environ) or any(a.startswith("--poll") for a in argv)
    assert bool(args.deprecated) == old
    if old:
        ((used, use),) = args.deprecated
        assert used in ("--poll-interval", "GPUFENCE_WEBHOOK_POLL_INTERVAL")
        assert use in ("--sidecar-poll-interval", "GPUFENCE_WEBHOOK_SIDECAR_POLL_INTERVAL")


def test_new_env_name_wins_over_the_old_one() -> None:
    environ = {"GPUFENCE_WEBHOOK_SIDECAR_METRICS_PORT": "9500", "GPUFENCE_WEBHOOK_METRICS_PORT": "9600"}
    args = parse_args(REQUIRED, environ=environ)
    assert args.sidecar_metrics_port == 9500 and args.deprecated == []


def test_old_and_new_flag_together_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([*REQUIRED, "--metrics-port=1", "--sidecar-metrics-port=2"], environ={})
    assert exited.value.code == 2 and "deprecated name --metrics-port" in capsys.readouterr().err


def test_a_deprecated_flag_is_logged_as_a_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpufence.webhook", "--poll-interval=1s", f"--tls-cert-file={tmp_path}/c",
         f"--tls-private-key-file={tmp_path}/k"],
        capture_output=True, text=True, timeout=60, check=False, cwd=Path(__file__).resolve().parents[2],
    )
    records = [json.loads(line) for line in result.stderr.splitlines()]
    (warning,) = [r for r in records if r["event"] == "deprecated_flag"]
    assert warning["level"] == "warning" and (warning["flag"], warning["use"]) == ("--poll-interval",
                                                                                  "--sidecar-poll-interval")
