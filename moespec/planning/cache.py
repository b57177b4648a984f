"""Backbone sketches kept between runs, so that `moespec validate` and `moespec plan` of a backbone seen before
import neither torch nor timm (seconds each): a plan reads only the backbone's sketch.

One JSON file per backbone, named by a hash of all that shapes its sketch: the timm model name and kwargs,
the versions of timm and torch, and the source of the code that reads a backbone (an edit to an adapter
starts afresh). The entry records that key too, and, per input size, whether the model took it. An entry is
trusted only when it is ours: a plain file of this user's that no one else may write, holding the key it is
filed under, and signed by this cache's writer (an HMAC of the entry with a random key kept in the cache folder,
private to the user, `.key-UID`): an entry planted or edited by hand, even as this user, matches no signature.
One that is missing, unreadable, unsigned, another user's (a shared `MOESPEC_CACHE_DIR`) or filed under
another key is rebuilt from the model, and a write that fails is skipped: the cache changes how fast an
answer comes, never the answer. The CLI uses it (`plan(spec, cached=True)`); the library does not,
since code that registers its own timm models, adapters or rebuilders may change them under the same name.

    MOESPEC_CACHE_DIR   where entries go (default: $XDG_CACHE_HOME/moespec, else ~/.cache/moespec); empty: off

A leading `~` in MOESPEC_CACHE_DIR is the home folder (a quoted `~` that the shell did not expand); a relative
folder in either variable is not used (the XDG rule: it would make folders wherever a command runs), and
MOESPEC_CACHE_DIR relative turns the cache off.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import Problem, SpecError
from ..files import RefusedFile, load_json, read_regular
from ..spec import BackboneSketch, Block, BlockLayout, FFNShape, Rescalable, Spec, located
from .checks import input_refusal, input_size_of, input_size_problem

FORMAT = 3  # of an entry's JSON (2: it records its key; 3: it is signed)
MAX_ENTRY_BYTES = 4_000_000  # a sketch of a 1,000-block model is ~200 kB
MAX_INPUT_SIZES = 32  # input-size outcomes kept per backbone
SKETCH_SOURCES = ("backbones", "spec/blocks.py", "planning/checks.py", "planning/cache.py")  # under moespec/


def backbone_facts(spec: Spec, *, cached: bool) -> tuple[BackboneSketch, Problem | None]:
    """The sketch of `spec`'s backbone and the problem with its input size (None when the model takes it):
    from the cache when it holds both, else from the backbone built on the meta device (then cached)."""
    file, key = entry_file(spec, with_key=True) if cached else (None, None)
    entry = _read(file, key) if file is not None else None
    refusals: dict[tuple[int, int, int], str | None] = {}
    if entry is not None:
        sketch, refusals = entry
        try:
            size = input_size_of(spec, sketch)
        except SpecError as error:
            return sketch, error.problems[0]
        if size in refusals:
            return sketch, _problem(spec, size, refusals[size])
    from ..backbones import create_backbone, sketch_of  # timm, torch: a backbone not seen before

    model = create_backbone(spec, device="meta")
    try:
        sketch = sketch_of(model)
    except SpecError as error:
        raise located(spec, error) from None
    try:
        size = input_size_of(spec, sketch)
    except SpecError as error:
        return sketch, error.problems[0]
    refusals = {size: input_refusal(model, size), **refusals}
    if file is not None:
        _write(file, key, sketch, dict(list(refusals.items())[:MAX_INPUT_SIZES]))
    return sketch, _problem(spec, size, refusals[size])


def cache_folder() -> Path | None:
    """Where entries go, or None when the cache is off (`MOESPEC_CACHE_DIR=`) or there is no home folder."""
    given = os.environ.get("MOESPEC_CACHE_DIR")
    try:
        if given is not None:
            folder = Path(given).expanduser() if given else None
            return folder if folder is not None and folder.is_absolute() else None
        xdg = Path(os.environ.get("XDG_CACHE_HOME") or "")
        return (xdg if xdg.is_absolute() else Path.home() / ".cache") / "moespec"
    except RuntimeError:  # no home folder
        return None


def entry_file(spec: Spec, *, with_key: bool = False) -> Any:
    """The entry of `spec`'s backbone, or None when there is no cache (or timm or torch is not installed); with
    `with_key`, (that file, the key it is filed under), or (None, None)."""
    folder = cache_folder()
    try:
        versions = {name: metadata.version(name) for name in ("timm", "torch")}
    except metadata.PackageNotFoundError:
        folder = None
    if folder is None:
        return (None, None) if with_key else None
    package = Path(__file__).resolve().parent.parent
    source = hashlib.sha256()
    for name in SKETCH_SOURCES:
        for file in sorted((package / name).glob("*.py")) if (package / name).is_dir() else [package / name]:
            source.update(file.read_bytes())
    key = {"format": FORMAT, "model": spec.backbone.model, "kwargs": spec.backbone.kwargs, "versions": versions,
           "source": source.hexdigest(), "pre_logits": spec.backbone.pre_logits}
    key = json.loads(json.dumps(key, sort_keys=True, default=repr))  # as it reads back from the entry
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    file = folder / "backbones" / f"{digest[:32]}.json"
    return (file, key) if with_key else file


def _problem(spec: Spec, size: tuple[int, int, int], refusal: str | None) -> Problem | None:
    return None if refusal is None else input_size_problem(spec, size, refusal)


def _signature(secret: bytes, entry: dict) -> str:
    """The HMAC-SHA256 of an entry's JSON (its fields but the signature, keys sorted)."""
    body = json.dumps({k: v for k, v in entry.items() if k != "signature"}, sort_keys=True).encode()
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def _secret(folder: Path, *, create: bool) -> bytes | None:
    """This user's signing key in the cache `folder` (32 random bytes, a plain file of this user's that no one
    else may read), made with `create` when there is none (through a temp file linked into place, so that of two
    writers at once one key wins whole); None when there is none or it is not ours."""
    file = folder / f".key-{os.geteuid()}"
    try:
        secret = read_regular(file, 64, own=True)
        return secret if len(secret) == 32 and not os.stat(file).st_mode & 0o077 else None
    except RefusedFile:
        if not create or os.path.lexists(file):
            return None
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, temp = tempfile.mkstemp(dir=folder, prefix=".key.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(secrets.token_bytes(32))
        with contextlib.suppress(FileExistsError):  # another writer's key won: use it
            os.link(temp, file)
    finally:
        os.unlink(temp)
    return _secret(folder, create=False)


def _write(file: Path, key: dict, sketch: BackboneSketch, refusals: dict) -> None:
    """Write the entry, signed, through a temp file and a rename (a reader sees all of it or none); skip it on
    failure. The file is private to this user (mkstemp's 0600), as `_read` requires."""
    entry = {"format": FORMAT, "key": key, "sketch": asdict(sketch),
             "inputs": [[list(size), refusal] for size, refusal in refusals.items()]}
    temp = None
    try:
        secret = _secret(file.parent.parent, create=True)
        if secret is None:
            return
        entry["signature"] = _signature(secret, entry)
        file.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.stem}.", suffix=".tmp")
        with os.fdopen(descriptor, "w") as out:
            json.dump(entry, out)
        os.replace(temp, file)
    except OSError:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def _read(file: Path, key: dict) -> tuple[BackboneSketch, dict] | None:
    """The entry at `file`, or None when there is none, it is not ours, or it is not a whole entry of this format
    filed under `key` and signed with this user's key."""
    try:
        # a plain file (never a fifo, device or link) of this user's that no one else may write: an entry another
        # user wrote in a shared cache folder, or could have changed, is not trusted
        entry = load_json(read_regular(file, MAX_ENTRY_BYTES, own=True))
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            return None
        secret = _secret(file.parent.parent, create=False)
        if secret is None or not hmac.compare_digest(str(entry.get("signature")), _signature(secret, entry)):
            return None
        refusals = {_ints(size, 3): _optional_str(refusal) for size, refusal in entry["inputs"]}
        return _sketch(entry["sketch"]), refusals
    except (RefusedFile, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _sketch(data: dict) -> BackboneSketch:
    """A sketch from its JSON form; TypeError or KeyError on anything that is not."""
    layout = data["layout"]
    blocks = tuple(Block(_int(b["index"]), _str(b["path"]), _int(b["stage"]), tuple(map(_str, b["sublayers"])))
                   for b in layout["blocks"])
    return BackboneSketch(
        layout=BlockLayout(blocks, tuple(tuple(map(_int, stage)) for stage in layout["stages"])),
        ffns={_str(path): FFNShape(_str(f["family"]), _int(f["in_features"]), _int(f["hidden"]),
                                   _int(f["out_features"]), _int(f["channels_dim"]),
                                   _str(f.get("mixes", "")))
              for path, f in data["ffns"].items()},
        block_types={_str(path): _str(name) for path, name in data["block_types"].items()},
        rescalable={_str(path): Rescalable(_int(r["tokens"]), _int(r["channels"]), _str(r["token_sublayer"]),
                                           _str(r["channel_sublayer"]))
                    for path, r in data["rescalable"].items()},
        rebuilt_types=tuple(map(_str, data["rebuilt_types"])),
        has_cls_token=_bool(data["has_cls_token"]),
        input_size=_ints(data["input_size"], 3),
    )


def _typed(kind: type) -> Any:
    def check(value: Any) -> Any:
        if type(value) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return check


_int, _str, _bool = _typed(int), _typed(str), _typed(bool)


def _optional_str(value: Any) -> str | None:
    return None if value is None else _str(value)


def _ints(values: Any, length: int) -> tuple[int, ...]:
    if not isinstance(values, list) or len(values) != length:
        raise TypeError(f"expected {length} integers")
    return tuple(map(_int, values))
