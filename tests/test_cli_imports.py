"""What the CLI's fast paths import: `import moespec`, `moespec --help`, `moespec schema` and reading a spec pay
neither torch nor timm (seconds each); the public API still resolves every name, on first use.

Each check runs in a fresh interpreter, since this one has imported torch long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import moespec

REPORT = "import json, sys; print(json.dumps({m: m in sys.modules for m in ('torch', 'timm')}))"


def imported_after(code: str) -> dict[str, bool]:
    """Run `code` in a fresh interpreter; which of torch and timm it imported."""
    done = subprocess.run([sys.executable, "-c", f"{code}\n{REPORT}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


NO_TORCH = {"torch": False, "timm": False}


@pytest.mark.parametrize("code", ["import moespec", "import moespec.cli", "from moespec import Spec, load_spec"])
def test_importing_the_package_and_the_cli_imports_no_torch(code):
    assert imported_after(code) == NO_TORCH


@pytest.mark.parametrize("args", [["--help"], ["validate", "--help"], ["schema"], ["bench", "--help"],
                                  ["eval", "--help"]])
def test_help_and_schema_import_no_torch(args):
    code = (f"from moespec.cli import app\ntry:\n    app({args!r})\nexcept SystemExit as exit:\n"
            f"    assert not exit.code, exit.code")
    assert imported_after(code) == NO_TORCH


def test_reading_a_spec_validates_router_kinds_without_torch():
    """The built-in router kinds are registered by `import moespec.spec` alone, before any spec is validated:
    an unknown kind is refused, and a known one gets its defaults."""
    code = """
from moespec.errors import SpecError
from moespec.spec import load_spec
group = {"where": {"every": 2}, "experts": 4}
try:
    load_spec({"backbone": {"model": "vit_small_patch16_224"}, "moe": [{**group, "router": {"kind": "nope"}}]})
    raise SystemExit("an unknown router kind was accepted")
except SpecError as error:
    assert "nope" in str(error), error
spec = load_spec({"backbone": {"model": "vit_small_patch16_224"}, "moe": [{**group, "router": {"kind": "soft"}}]})
assert spec.moe[0].router.slots_per_expert == 1 and spec.moe[0].aux_loss == []
"""
    assert imported_after(code) == NO_TORCH


@pytest.mark.slow  # a Python subprocess that imports torch and timm: CI runs it
def test_using_the_api_imports_torch_then():
    assert imported_after("from moespec import create_model") == {"torch": True, "timm": True}


def test_every_public_name_resolves():
    for name in moespec.__all__:
        assert getattr(moespec, name) is not None, name
    assert set(moespec.__all__) <= set(dir(moespec))
    assert moespec.create_model.__module__.startswith("moespec.compiler")
    namespace: dict = {}
    exec("from moespec import *", namespace)
    assert set(moespec.__all__) <= set(namespace)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'create_modle'"):
        moespec.create_modle  # noqa: B018


def imported_by_command(args: list[str], cwd) -> tuple[int, dict[str, bool], str]:
    """Run `moespec ARGS` in a fresh interpreter in `cwd`: its exit code, which of torch and timm it imported,
    and its stderr."""
    code = (f"import sys\nsys.argv = ['moespec', *{args!r}]\nfrom moespec.cli import main\ntry:\n    main()\n"
            f"except SystemExit as exit:\n    code = exit.code\n{REPORT.replace('print(', 'print(code, ', 1)}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)
    last = done.stdout.splitlines()[-1]
    exit_code, report = last.split(" ", 1)
    return int(exit_code), json.loads(report), done.stderr


OLD_RELEASE = "backbone: {model: vit_small_patch16_224}\nmoe:\n  - where: {every: 2}\n    experts: 4\n    top_k: 2\n"


@pytest.mark.parametrize("args", [
    ["compile", "spec.yaml", "-o", "exists.safetensors"],
    ["upcycle", "spec.yaml", "-o", "exists.safetensors"],
    ["compile", "spec.yaml", "-o", "new.safetensors", "--max-shard-size", "2XB"],
])
def test_an_output_that_exists_is_refused_before_torch_is_imported(tmp_path, args):
    """"already exists; pass --force" took 26 s (issue 52): torch and timm were imported before the output was
    checked. The spec is not even read."""
    (tmp_path / "exists.safetensors").write_bytes(b"kept")
    code, imported, stderr = imported_by_command(args, tmp_path)
    assert (code, imported) == (2, NO_TORCH), stderr
    assert stderr in ("moespec: error: exists.safetensors already exists; pass --force to overwrite it\n",
                      "moespec: error: --max-shard-size '2XB': expected a size such as 2GB, 500MB or 1GiB\n")
    assert (tmp_path / "exists.safetensors").read_bytes() == b"kept"


def test_plan_and_validate_fix_with_a_warm_cache_import_no_torch(tmp_path):
    """With the backbone's sketch cached (filled here, in this process), `plan` and `validate --fix` read the
    spec, plan it and print or rewrite it without torch or timm (issue 52: 13-40 s and 850 MB each)."""
    (tmp_path / "spec.yaml").write_text(OLD_RELEASE)
    moespec.plan(moespec.load_spec(tmp_path / "spec.yaml"), cached=True)  # the cache of this test session
    code, imported, stderr = imported_by_command(["plan", "spec.yaml"], tmp_path)
    assert (code, imported, stderr) == (0, NO_TORCH, "")
    code, imported, stderr = imported_by_command(["validate", "--fix", "spec.yaml"], tmp_path)
    assert (code, imported) == (0, NO_TORCH), stderr
    assert stderr == "moespec: fixed: spec.yaml: moe.0.top_k: moved into the router\n"
    assert moespec.load_spec(tmp_path / "spec.yaml").moe[0].router.top_k == 2
    assert "top_k" in (tmp_path / "spec.yaml").read_text().split("router:", 1)[1]


@pytest.mark.parametrize("args", [["bench", "absent.yaml"], ["eval", "absent.safetensors", "--images", "."]])
def test_a_missing_source_of_bench_and_eval_is_refused_before_torch_is_imported(tmp_path, args):
    code, imported, stderr = imported_by_command(args, tmp_path)
    assert (code, imported) == (2, NO_TORCH), stderr
    assert stderr == f"moespec: error: {args[1]}: no such spec, checkpoint or folder\n"
