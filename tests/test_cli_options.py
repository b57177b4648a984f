"""The CLI's shared options: the commands that write a checkpoint take the same output options, defined once."""

from __future__ import annotations

import typer

from moespec.cli import app

SHARED = ("output", "max_shard_size", "force")


def _params(command: str) -> dict:
    click_command = typer.main.get_command(app).commands[command]
    return {p.name: (p.opts, p.secondary_opts, p.help, p.default, p.required) for p in click_command.params}


def test_compile_and_upcycle_take_the_same_output_options():
    compile_params, upcycle_params = _params("compile"), _params("upcycle")
    for name in SHARED:
        assert compile_params[name] == upcycle_params[name], name
    assert compile_params["output"][:3] == (
        ["-o", "--output"], [], "Output .safetensors file; beyond --max-shard-size, shards and an index next to it.")
    assert compile_params["output"][4] and not compile_params["force"][3]
    assert compile_params["max_shard_size"][3] == "2GB"
