"""Usage mistakes on the command line (a missing option argument, an unknown option, a bad choice) are one
`moespec: error:` line naming the command, exit 2, as every other mistake is: not click's usage lines and
typer's three-line box (issue 52)."""

from __future__ import annotations

import pytest

from moespec.apps.terminal import run_app
from moespec.cli import app


@pytest.mark.parametrize("args, line", [
    (["stats", "a.yaml", "--format"],
     "moespec: error: stats: option '--format' requires an argument; see `moespec stats --help`"),
    (["upcycle", "a.yaml", "-o"], "moespec: error: upcycle: option '-o' requires an argument; see `moespec upcycle "
                                  "--help`"),
    (["stats", "a.yaml", "--input-size", "3", "4"],
     "moespec: error: stats: option '--input-size' requires 3 arguments; see `moespec stats --help`"),
    (["stats"], "moespec: error: stats: missing argument 'specs'; see `moespec stats --help`"),
    (["plan", "a.yaml", "--bogus"], "moespec: error: plan: no such option: --bogus; see `moespec plan --help`"),
    (["nosuch"], "moespec: error: no such command 'nosuch'; see `moespec --help`"),
])
def test_a_usage_mistake_is_one_line_and_exit_2(capsys, args, line):
    assert run_app(app, args) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", line + "\n")


def test_help_and_a_command_keep_their_exit_codes(capsys, tmp_path):
    assert run_app(app, ["--help"]) == 0
    assert "Usage: moespec" in capsys.readouterr().out
    assert run_app(app, ["validate", str(tmp_path / "absent.yaml")]) == 2
    assert capsys.readouterr().err == f"moespec: error: {tmp_path / 'absent.yaml'}: no such spec file\n"
    assert run_app(app, ["schema"]) == 0
    assert capsys.readouterr().out.startswith("{")
