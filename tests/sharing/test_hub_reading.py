"""What moespec reads from a Hub folder, and what it refuses unread (issue 64, Reliability V): odd weight files
(a fifo, a link to a device, a folder, an empty or truncated file, a socket) and weight files that would inflate
past what the model's weights can take, through `timm.create_model("local-dir:...")`, `moespec.load` and the CLI."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tracemalloc
import zipfile

import pytest
import timm
import torch
from typer.testing import CliRunner

import moespec
import moespec.weights.dense as dense
from moespec.cli import app

from .test_hub_folder import _model, _same_outputs

WEIGHTS = "model.safetensors"


@pytest.fixture
def saved(tmp_path):
    """A moespec Hub folder of a tiny model, and the model."""
    model = _model(tmp_path)
    return moespec.save_for_hf(model, tmp_path / "hub"), model


def _socket(path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    return server


ODD_WEIGHTS = {
    "fifo": (lambda path, good: os.mkfifo(path), "a fifo"),
    "link to /dev/zero": (lambda path, good: os.symlink("/dev/zero", path), "a symbolic link"),
    "folder": (lambda path, good: path.mkdir(), "a folder"),
    "empty": (lambda path, good: path.write_bytes(b""), "an empty file"),
    "truncated": (lambda path, good: path.write_bytes(good[: len(good) // 2]), "truncated"),
    "socket": (lambda path, good: _socket(path), "a socket"),
}


@pytest.fixture(params=sorted(ODD_WEIGHTS))
def odd_folder(request, saved, no_hang):
    """The Hub folder with its model.safetensors replaced by an odd file; what the error must say about it."""
    folder, _ = saved
    good = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).unlink()
    make, words = ODD_WEIGHTS[request.param]
    made = make(folder / WEIGHTS, good)
    yield folder, words
    if isinstance(made, socket.socket):
        made.close()


def test_odd_weight_files_are_one_located_error_through_timm_and_moespec(odd_folder):
    folder, words = odd_folder
    for read in (lambda: timm.create_model(f"local-dir:{folder}", pretrained=True), lambda: moespec.load(folder)):
        with pytest.raises(moespec.MoespecError) as raised:
            read()
        message = str(raised.value)
        assert f"{folder / WEIGHTS}:" in message and words in message, message


def test_odd_weight_files_exit_2_through_the_cli(odd_folder, tmp_path):
    folder, words = odd_folder
    (tmp_path / "images").mkdir()
    result = CliRunner().invoke(app, ["eval", str(folder), "--images", str(tmp_path / "images")])
    assert result.exit_code == 2, result.output
    assert WEIGHTS in result.output and words in result.output and "Traceback" not in result.output


def _never_read(monkeypatch):
    """Make any read of a weight file's tensors fail the test: a refusal must come before it."""
    def read(*args, **kwargs):
        raise AssertionError("the weight file was read before it was refused")

    monkeypatch.setattr(torch, "load", read)
    monkeypatch.setattr(dense, "load_file", read)


def _bin_folder(folder, state):
    (folder / WEIGHTS).unlink()
    torch.save(state, folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin"


def _declare(file, record_suffix: str, size: int) -> None:
    """Make the zip record of `file` whose name ends with `record_suffix` declare `size` uncompressed bytes, in its
    local header and in the central directory: a file a few kB on disk that says it inflates to `size`."""
    data = bytearray(file.read_bytes())
    with zipfile.ZipFile(file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    central, name = 0, info.filename.encode()
    while True:  # the central directory entry of this record
        central = data.index(b"PK\x01\x02", central)
        if data[central + 46: central + 46 + len(name)] == name:
            break
        central += 4
    struct.pack_into("<I", data, central + 24, size)
    struct.pack_into("<I", data, info.header_offset + 22, size)
    file.write_bytes(bytes(data))
    with zipfile.ZipFile(file) as archive:
        assert sum(i.file_size for i in archive.infolist()) >= size  # the bomb declares what it should


def test_a_zip_bomb_pytorch_model_bin_is_refused_before_it_is_inflated(saved, monkeypatch):
    folder, model = saved
    file = _bin_folder(folder, model.state_dict())
    _declare(file, "data/0", 2**31)  # 2 GB declared, the file stays small
    assert file.stat().st_size < 2**22
    _never_read(monkeypatch)
    for read in (lambda: timm.create_model(f"local-dir:{folder}", pretrained=True), lambda: moespec.load(folder)):
        tracemalloc.start()
        with pytest.raises(moespec.MoespecError, match="pytorch_model.bin: its zip records inflate to") as raised:
            read()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert str(file) in str(raised.value) and peak < 2**28, (str(raised.value), peak)


def test_a_weight_file_larger_than_the_model_can_take_is_refused_unread(saved, monkeypatch):
    """Uncompressed, as torch.save writes it (no inflation on disk), but with more bytes than `weight_cap`."""
    folder, model = saved
    cap = dense.weight_cap(model)
    state = {**model.state_dict(), "extra": torch.zeros(cap // 4 + 1)}
    file = _bin_folder(folder, state)
    assert file.stat().st_size * dense.MAX_INFLATION > cap  # the file-size ratio alone would let it through
    _never_read(monkeypatch)
    for read in (lambda: timm.create_model(f"local-dir:{folder}", pretrained=True), lambda: moespec.load(folder)):
        with pytest.raises(moespec.MoespecError, match="more than the .* that the model's weights can take"):
            read()


def test_a_plain_pytorch_model_bin_still_loads(saved):
    """The refusals above leave a real pytorch_model.bin (timm's other weight name) readable."""
    folder, model = saved
    _bin_folder(folder, model.state_dict())
    _same_outputs(model, timm.create_model(f"local-dir:{folder}", pretrained=True))
    _same_outputs(model, moespec.load(folder))


def test_a_copied_folder_still_loads(saved, tmp_path):
    folder, model = saved
    copy = shutil.copytree(folder, tmp_path / "copy")
    _same_outputs(model, timm.create_model(f"local-dir:{copy}", pretrained=True))


def _cached(folder, cache, *, links=None):
    """`folder` laid out as huggingface_hub's cache keeps a download: CACHE/models--x--y/blobs/HASH for each file,
    snapshots/abc/NAME a relative link to it, refs/main naming the revision. `links`: NAME -> a link target to
    plant instead."""
    repo = cache / "models--x--y"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for index, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{index:040x}"
        shutil.copyfile(file, blob)
        os.symlink((links or {}).get(file.name, os.path.join("..", "..", "blobs", blob.name)), snapshot / file.name)
    return snapshot


def test_a_snapshot_of_the_hugging_face_cache_is_read_through_its_links(saved, tmp_path):
    folder, model = saved
    snapshot = _cached(folder, tmp_path / "cache")
    assert all(path.is_symlink() for path in snapshot.iterdir())
    _same_outputs(model, moespec.load(snapshot))
    _same_outputs(model, timm.create_model(f"local-dir:{snapshot}", pretrained=True))
    assert moespec.spec.hub_spec(snapshot).to_yaml() == moespec.spec.hub_spec(folder).to_yaml()
    result = CliRunner().invoke(app, ["stats", str(snapshot), "--format", "json"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["config.json", WEIGHTS])
@pytest.mark.parametrize("where, words", [
    ("outside", "out of its Hugging Face cache repository"),
    ("other repo", "out of its Hugging Face cache repository"),
    ("loop", "loops or leads nowhere"),
    ("nowhere", "loops or leads nowhere"),
    ("device", "out of its Hugging Face cache repository"),
    ("fifo blob", "a symbolic link to a fifo"),
])
def test_a_cache_link_that_leaves_its_repository_is_refused(saved, tmp_path, no_hang, name, where, words):
    folder, _ = saved
    cache = tmp_path / "cache"
    other = cache / "models--x--other" / "blobs"
    other.mkdir(parents=True)
    shutil.copyfile(folder / name, other / "copy")
    shutil.copyfile(folder / name, tmp_path / "outside")
    (cache / "models--x--y" / "blobs").mkdir(parents=True)
    os.mkfifo(cache / "models--x--y" / "blobs" / "fifo")
    target = {
        "outside": str(tmp_path / "outside"),
        "other repo": os.path.join("..", "..", "..", "models--x--other", "blobs", "copy"),
        "loop": name,
        "nowhere": os.path.join("..", "..", "blobs", "missing"),
        "device": "/dev/zero",
        "fifo blob": os.path.join("..", "..", "blobs", "fifo"),
    }[where]
    snapshot = _cached(folder, cache, links={name: target})
    with pytest.raises(moespec.MoespecError) as raised:
        moespec.load(snapshot)
    assert f"{snapshot / name}:" in str(raised.value) and words in str(raised.value), str(raised.value)
    if name == WEIGHTS:  # timm reads config.json itself; the weights are moespec's to read
        with pytest.raises(moespec.MoespecError, match=words):
            timm.create_model(f"local-dir:{snapshot}", pretrained=True)


def test_links_in_an_ordinary_folder_are_still_refused(saved, tmp_path):
    """Only a snapshot of the cache (REPO/snapshots/REVISION beside REPO/blobs) has its links followed."""
    folder, _ = saved
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in folder.iterdir():
        os.symlink(file, plain / file.name)
    with pytest.raises(moespec.MoespecError, match="config.json: a symbolic link; it is read only as a plain file"):
        moespec.load(plain)
    fake = tmp_path / "fake" / "snapshots" / "abc"  # the names, without the cache's blobs folder beside them
    shutil.copytree(plain, fake, symlinks=True)
    with pytest.raises(moespec.MoespecError, match="config.json: a symbolic link; it is read only as a plain file"):
        moespec.load(fake)


def test_hf_hub_reads_the_weights_from_the_cache_as_a_local_snapshot(saved, tmp_path, monkeypatch):
    """`hf-hub:` weights come from timm's download into Hugging Face's cache (answered here from a hand-built
    cache, no network): read through the snapshot's links, and refused where a link leaves the repository."""
    folder, model = saved
    snapshot = _cached(folder, tmp_path / "cache")

    def download(repo_id, filename, revision=None, cache_dir=None, **_):
        if not os.path.lexists(snapshot / filename):
            raise timm.models._hub.EntryNotFoundError(filename)
        return str(snapshot / filename)

    monkeypatch.setattr(timm.models._hub, "hf_hub_download", download)
    _same_outputs(model, timm.create_model("hf-hub:x/y", pretrained=True))
    (snapshot / WEIGHTS).unlink()
    shutil.copyfile(folder / WEIGHTS, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", snapshot / WEIGHTS)
    with pytest.raises(moespec.MoespecError, match=f"{WEIGHTS}: a symbolic link out of its Hugging Face cache"):
        timm.create_model("hf-hub:x/y", pretrained=True)
