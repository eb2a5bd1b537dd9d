"""The tensor files of a Hugging Face model folder, opened one at a time, with errors that
name the file.

A folder holds its weights as .safetensors (one file, or shards with
``model.safetensors.index.json``) or, as many fine-tunes still ship, as PyTorch pickles:
``pytorch_model.bin`` or shards ``pytorch_model-0000x-of-0000y.bin`` with
``pytorch_model.bin.index.json``. ``from_pretrained`` reads both (safetensors first when
a folder has both); meta-device init (``trainer/sharded_init.py``) reads each rank's rows
of either through :func:`open_tensors`:

* .safetensors: ``safe_open`` (the file memory-mapped, a tensor's slice reads only its
  pages);
* .bin: ``torch.load(weights_only=True, mmap=True)``, what ``from_pretrained`` itself
  calls for a zip-format file: torch's restricted unpickler builds tensors, dicts and
  primitives only (any other object is refused, never constructed), and the tensors'
  storage is the memory-mapped file, so a slice reads only its pages as with safetensors.
  A .bin in torch's pre-1.6 format (not a zip) cannot be memory-mapped: it is
  :class:`NotSliceable` and the caller loads the whole model instead.

A file that cannot be read (truncated, corrupt, missing though an index names it, lacking
a tensor its index places there) is :class:`CheckpointUnreadable` naming the file; the
libraries' own errors do not ("incomplete metadata, file not fully covered";
"PytorchStreamReader failed reading zip archive").
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since 1.6 is a zip archive


class CheckpointUnreadable(ValueError):
    """A weights file of the checkpoint cannot be read (truncated, corrupt, missing, a
    tensor whose shape is not the model's): the message names the file."""


class NotSliceable(Exception):
    """The checkpoint's files cannot be read a slice at a time (a pre-1.6 torch pickle):
    only the whole-model load reads it."""


class _TorchSlice:
    """One tensor of a .bin, with the two calls of safetensors' slice that meta init uses."""

    def __init__(self, tensor: "torch.Tensor") -> None:
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def __getitem__(self, item) -> "torch.Tensor":
        return self._tensor[item]


class _TorchFile:
    """A loaded (memory-mapped) .bin state dict, read like a safetensors handle."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def keys(self) -> list[str]:
        return list(self._state)

    def get_slice(self, key: str) -> _TorchSlice:
        return _TorchSlice(self._state[key])


@contextlib.contextmanager
def open_tensors(file: Path) -> Iterator[object]:
    """The tensors of one weights file (``keys()``, ``get_slice(key)[rows]``), its errors
    naming the file. Open per use: while open, the pages read count in the RSS."""
    if file.suffix == ".safetensors":
        with _open_safetensors(file) as f:
            yield f
        return
    state = _load_bin(file)
    try:
        yield _TorchFile(state)
    finally:
        del state  # drops the mapping with the last tensor


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator[object]:
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointUnreadable(f"{file}: not a readable .safetensors file (truncated or corrupt?): {err}") from err
    with handle as f:
        yield f


def _load_bin(file: Path) -> dict:
    import torch

    try:
        with open(file, "rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
    except OSError as err:
        raise CheckpointUnreadable(f"{file}: not a readable .bin file (missing?): {err}") from err
    if magic != _ZIP_MAGIC:
        raise NotSliceable(f"{file}: not a zip-format torch file (saved by torch < 1.6?), cannot be memory-mapped")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        # A truncated zip lacks its central directory; weights_only refuses any object
        # that is not a tensor or a plain container (UnpicklingError).
        raise CheckpointUnreadable(f"{file}: not a readable .bin file (truncated or corrupt?): {err}") from err
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointUnreadable(f"{file}: not a state dict of tensors ({type(state).__name__})")
    return state


def checkpoint_index(model_path: str) -> dict[str, Path]:
    """Tensor name -> the weights file holding it: ``model.safetensors``, else
    ``model.safetensors.index.json``'s shards, else ``pytorch_model.bin``, else
    ``pytorch_model.bin.index.json``'s shards: the order from_pretrained picks them in
    (between the safetensors and the .bin, the folder's .safetensors files without an
    index, as meta init read them before). Every file is opened once here (a header, or
    a .bin's pickle of tensor records: no tensor data), so a truncated, corrupt or
    missing file is an error naming it before any rank shards.
    FileNotFoundError: no weights files; NotSliceable: a pre-1.6 .bin."""
    folder = Path(model_path)
    if (folder / SAFE_SINGLE).exists():
        return _from_files([folder / SAFE_SINGLE])
    if (folder / SAFE_INDEX).exists():
        return _from_index(folder, SAFE_INDEX)
    files = sorted(folder.glob("*.safetensors"))  # shards without an index
    if files:
        return _from_files(files)
    if (folder / BIN_SINGLE).exists():
        return _from_files([folder / BIN_SINGLE])
    if (folder / BIN_INDEX).exists():
        return _from_index(folder, BIN_INDEX)
    raise FileNotFoundError(f"{model_path}: no .safetensors or pytorch_model.bin files")


def _from_files(files: list[Path]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for file in files:
        with open_tensors(file) as f:
            out.update({name: file for name in f.keys()})
    return out


def _from_index(folder: Path, index_name: str) -> dict[str, Path]:
    try:
        weight_map = json.loads((folder / index_name).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointUnreadable(f"{folder / index_name}: not a readable index: {err!r}") from err
    out = {name: folder / file for name, file in weight_map.items()}
    by_file: dict[Path, set[str]] = {}
    for name, file in out.items():
        by_file.setdefault(file, set()).add(name)
    for file, names in sorted(by_file.items()):
        with open_tensors(file) as f:
            absent = sorted(names - set(f.keys()))
        if absent:
            raise CheckpointUnreadable(f"{file}: lacks {absent[:3]} ({len(absent)} tensors), "
                                       f"which {index_name} places there")
    return out


def check_readable(model_path: str) -> None:
    """Every weights file the checkpoint's index (or folder) names opens: raises
    :class:`CheckpointUnreadable` naming the first that does not. A folder without
    weights files or with a pre-1.6 .bin is left to ``from_pretrained`` (which reads or
    refuses it whole)."""
    with contextlib.suppress(FileNotFoundError, NotSliceable):
        checkpoint_index(model_path)
