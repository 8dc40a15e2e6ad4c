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


def test_command_map_matches_what_the_modules_register() -> None:
    """Running one command imports only its module, so the map must name every command."""
    import argparse

    from inferwatch.cli import COMMANDS, build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(COMMANDS)
    for command, module in COMMANDS.items():
        one = build_parser(command)
        (one_sub,) = [a for a in one._actions if isinstance(a, argparse._SubParsersAction)]
        assert command in one_sub.choices, f"{module} does not register {command!r}"


def test_errors_are_one_line_under_python_dash_m(tmp_path) -> None:
    import sys

    for module in ("inferwatch", "inferwatch.cli"):
        proc = subprocess.run(
            [sys.executable, "-m", module, "rules", "build", "--spec", str(tmp_path / "missing.yaml")],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"inferwatch: error: {tmp_path / 'missing.yaml'}: no such file "
            "(pass the fleet spec with --spec, e.g. fleet.yaml)"
        ]


def test_every_entry_point_reports_errors_the_same_way(tmp_path) -> None:
    """``inferwatch.cli.run`` is the one exit path: a CliError is one line, no traceback."""
    import sys

    missing = tmp_path / "missing.yaml"
    cases = [
        (["-m", "sidecar", "--spec", str(missing)], f"inferwatch: error: {missing}: no such file"),
        (["-m", "exporters", "--backend", "simulated", "--port", "99999"], "inferwatch: error: --port"),
    ]
    for argv, start in cases:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(start), proc.stderr


def test_run_maps_errors_and_interrupts_to_exit_codes(capsys) -> None:
    from inferwatch.cli import CliError, run

    def fails() -> int:
        raise CliError("bad thing", 3)

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert run(lambda: None) == 0 and run(lambda: 4) == 4
    assert run(fails) == 3
    assert capsys.readouterr().err == "inferwatch: error: bad thing\n"
    assert run(interrupted) == 130


def test_one_log_module_two_formats_same_keys_in_utc(tmp_path) -> None:
    """inferwatch/logs.py: JSON for services and files, logfmt for a person's stderr; the
    same keys either way, times in UTC whatever the machine's zone."""
    import datetime
    import io
    import json
    import os
    import time

    from inferwatch import logs

    old_tz = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"  # a local-time formatter would show it
    time.tzset()
    try:
        text, file = io.StringIO(), tmp_path / "logs" / "x.log"
        logs.setup("info", "inferwatch.test", "logfmt", stream=text, stream_level="warning", file=file)
        log = logs.get("inferwatch.test")
        log.info("ready", component="sidecar", seconds=1.5)
        log.warning("did not stop in time; killing", component="triton", detail='a "quoted" = b')
        log.debug("never formatted", component="x")
    finally:
        if old_tz is None:
            os.environ.pop("TZ")
        else:
            os.environ["TZ"] = old_tz
        time.tzset()
        logs.setup("info", "inferwatch.test")
    lines = [json.loads(ln) for ln in file.read_text().splitlines()]  # the file: every line, JSON
    assert [ln["msg"] for ln in lines] == ["ready", "did not stop in time; killing"]
    assert lines[0]["component"] == "sidecar" and lines[0]["seconds"] == 1.5
    for ln in lines:  # read as UTC, the stamp is now (a local-time stamp would be hours off)
        stamp = datetime.datetime.fromisoformat(ln["ts"].replace("Z", "+00:00")).timestamp()
        assert ln["ts"].endswith("Z") and abs(stamp - time.time()) < 60
    [line] = text.getvalue().splitlines()  # the stream: warnings only, logfmt, same keys
    assert line.startswith(f"ts={lines[1]['ts']} level=warning logger=inferwatch.test ")
    assert line.endswith('msg="did not stop in time; killing" component=triton detail="a \\"quoted\\" = b"')
