"""--help of the CLIs is their reference: every option explained, defaults shown as one writes them."""

from __future__ import annotations

import argparse

import pytest

from certs.cli import build_parser as certs_parser
from webhook.cli import FLAGS
from webhook.cli import build_parser as webhook_parser


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
