"""The console script: --help, --version, and no subcommand."""

from __future__ import annotations

import subprocess
from pathlib import Path

from inferwatch import __version__

BIN = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "inferwatch"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(BIN) if BIN.exists() else "inferwatch"
    return subprocess.run([exe, *args], capture_output=True, text=True)


def test_version() -> None:
    proc = run("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"inferwatch {__version__}"


def test_help_lists_commands() -> None:
    proc = run("--help")
    assert proc.returncode == 0
    assert "spec" in proc.stdout


def test_no_command_prints_help_and_fails() -> None:
    proc = run()
    assert proc.returncode == 2
    assert "usage: inferwatch" in proc.stdout


def test_unknown_command_is_a_usage_error() -> None:
    proc = run("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
