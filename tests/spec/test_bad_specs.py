"""The bad-spec corpus: every file in `tests/data/bad_specs` is a spec with one mistake (or a few), and
`moespec plan FILE` must report it as a user error: exit code 2, `moespec: error: FILE:LINE:COL: field.path:
message` lines on stderr, and no traceback.

Each file says what it must produce in its first lines:

    # expect: <a fragment of the error output>     (one line per fragment, at least one)
    # expect-line: <N>                             (optional: the first fragment is reported at line N)

The expectations are ASCII, so a file that is not UTF-8 (the mistake of `not_utf8.yaml`) states them too.

The commands run in-process (typer's CliRunner), so the corpus pays the torch / timm import once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moespec.cli import app

CORPUS = Path(__file__).parent.parent / "data" / "bad_specs"
FILES = sorted(CORPUS.glob("*.yaml"))


def expectations(path: Path) -> tuple[list[str], int | None]:
    """The `# expect:` fragments and the `# expect-line:` of a corpus file."""
    fragments, line = [], None
    for text in path.read_bytes().decode("utf-8", "replace").splitlines():  # not_utf8.yaml is not
        if text.startswith("# expect: "):
            fragments.append(text.removeprefix("# expect: "))
        elif text.startswith("# expect-line: "):
            line = int(text.removeprefix("# expect-line: "))
    return fragments, line


def test_the_corpus_covers_many_mistakes():
    assert len(FILES) >= 40
    assert all(expectations(path)[0] for path in FILES), "every corpus file needs an '# expect: ' line"


@pytest.mark.parametrize("path", FILES, ids=lambda path: path.stem)
def test_plan_reports_the_mistake(path):
    fragments, line = expectations(path)
    result = CliRunner().invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines, "no error message"
    assert all(text.startswith(f"moespec: error: {path}") for text in lines), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr
    if line is not None:
        first = next(text for text in lines if fragments[0] in text)
        assert first.startswith(f"moespec: error: {path}:{line}:"), first


def test_validate_reports_every_file_of_the_corpus():
    result = CliRunner().invoke(app, ["validate", str(CORPUS)])
    assert result.exit_code == 2
    assert result.stdout == ""  # no file passes
    named = {text.removeprefix("moespec: error: ").split(":")[0] for text in result.stderr.splitlines()}
    assert named == {str(path) for path in FILES}
