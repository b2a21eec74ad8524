"""What a checkpoint holds, read without its tensor data: each tensor's dtype and shape, by key.

- `torch.distributed.checkpoint`: a directory with a `.metadata` file, read as DCP's own reader
  reads it (a pickle), each of DCP's metadata classes a stand-in keeping its pickled state (no
  code of the file, nor of DCP's classes, runs).
- safetensors: a `.safetensors` file (its JSON header, checked as safetensors checks it: each
  tensor's dtype, shape and byte range, the ranges tiling the data), a `*.safetensors.index.json`
  index of shards, or a directory holding either (Hugging Face's `save_pretrained`, PEFT's
  `adapter_model.safetensors`); a directory of `pytorch_model*.bin` files (or their
  `*.bin.index.json`), read as `torch.save` files.
- `torch.save`: a zip file, read from its pickle record alone (`data.pkl`), or a file in the
  legacy format (`_use_new_zipfile_serialization=False`), read from its pickles before the
  storages: tensors are seen by their dtype and shape (tensor subclasses such as torchao's by
  the dtype and shape they present), no storage is read and no code of the file runs (any class
  it names is a stand-in), so a Lightning checkpoint reads as a plain one and a whole pickled
  `nn.Module` as its state dict.

Beside the tensors, `torch_save_record` gives a `torch.save` file's whole object (numbers and
strings as themselves), and `dcp_objects` the small objects a DCP checkpoint saved as bytes (a
schedule's phase, read by `phases`).

Nested dictionaries are flattened with ".", as DCP flattens them: `{"model": {"fc.weight": t}}`
reads as `"model.fc.weight"`; an object reached by several paths is read once, under the first.
The work and memory are bounded by the size of the files read (`pickles` walks each pickle
before it is read; a zip record declared larger than its file is not inflated). Whatever the
path holds that this cannot read is a `ValueError` naming the file and what was expected.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeGuard

import torch

from precision_annot._src.checkpoints import pickles

__all__ = ["MAX_DCP_OBJECT", "MAX_HEADER", "OPTIMIZER_FILE", "SAFETENSORS_BITS", "Saved",
           "adapter_config", "dcp_objects", "is_dcp", "optimizer_beside", "saved_tensors",
           "torch_save_record"]


@dataclasses.dataclass(frozen=True)
class Saved:
    """One tensor a checkpoint holds: its dtype (None for a safetensors dtype torch has no
    dtype for, such as F4: present, not compared) and shape."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]


#: safetensors' dtype names (its header's "dtype"), as `safetensors.torch` maps them
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu, "C64": torch.complex64, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
    "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
#: the largest safetensors header read: safetensors itself refuses larger ones
#: (`MAX_HEADER_SIZE` of its reader, 100 MB), so a corrupt length is never read into memory
MAX_HEADER = 100_000_000


def saved_tensors(path: str | os.PathLike[str]) -> dict[str, Saved]:
    """Every tensor a checkpoint at `path` holds, by its flattened key, read without its data,
    in time and memory bounded by the size of the files read.

    Raises:
        ValueError: naming the file, for a path that holds no checkpoint this reads (naming
            what it looks for), a file that is not the checkpoint its name says (a corrupt header,
            an index naming shards that are not there), one that declares more than it holds (a
            length past its end, a zip bomb, objects nested or shared past any checkpoint's), or
            one that cannot be read at all (a symlink loop, no permission).
    """
    try:
        return _read(Path(path), path)
    except OSError as e:
        raise ValueError(
            f"checkpoint: {str(e.filename or path)!r} cannot be read ({type(e).__name__}: "
            f"{e.strerror or e}).") from e


def _read(where: Path, path: str | os.PathLike[str]) -> dict[str, Saved]:
    try:
        mode = where.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"checkpoint: no file or directory at {str(path)!r}.") from None
    if stat.S_ISDIR(mode):
        return _directory(where, path)
    if where.name.endswith(".index.json"):
        return _index(where)
    return _file(where)


def _size(file: Path) -> int:
    """The size of a regular file (not a FIFO, which would block a read, nor a device)."""
    status = file.stat()
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"checkpoint: {str(file)!r} is not a regular file (a directory, FIFO, "
                         "socket or device), so it holds no checkpoint this reads.")
    return status.st_size


def _file(where: Path) -> dict[str, Saved]:
    return _safetensors(where) if where.suffix == ".safetensors" else _torch_save(where)


def _present(file: Path) -> bool:
    """Whether anything is at `file`, a broken or looping symlink included (read, it says why
    it cannot be)."""
    return file.is_symlink() or file.exists()


#: the file the Hugging Face Trainer saves the optimizer's `state_dict()` in, beside the model's
#: weights in each `checkpoint-N` folder
OPTIMIZER_FILE = "optimizer.pt"


def is_dcp(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a DCP checkpoint (a directory with a `.metadata` file)."""
    return Path(path).is_dir() and _present(Path(path) / ".metadata")


def optimizer_beside(path: str | os.PathLike[str]) -> Path | None:
    """The optimizer's state (`OPTIMIZER_FILE`) in a folder of a model's weights (the Hugging
    Face Trainer's `checkpoint-N`), None for a file, a DCP directory or a folder without one."""
    where = Path(path)
    if not where.is_dir() or is_dcp(where):
        return None
    file = where / OPTIMIZER_FILE
    return file if _present(file) else None


def _directory(where: Path, path: str | os.PathLike[str]) -> dict[str, Saved]:
    if _present(where / ".metadata"):
        return _dcp(where)
    for pattern in ("safetensors", "bin"):  # Hugging Face's layouts, safetensors first
        indexes = sorted(where.glob(f"*.{pattern}.index.json"))
        if indexes:
            return _index(indexes[0])
        files = sorted(where.glob(f"*.{pattern}"))
        if files:
            return {k: v for f in files for k, v in _file(f).items()}
    if any(where.glob("*.distcp")):
        raise ValueError(
            f"checkpoint: {str(path)!r} holds DCP data files (*.distcp) but no .metadata file, "
            "which DCP writes last, when every rank has saved: the save did not finish (or the "
            "file was not copied), and dcp.load refuses it too.")
    raise ValueError(
        f"checkpoint: {str(path)!r} is a directory without a checkpoint this reads: a DCP "
        "checkpoint (a .metadata file), *.safetensors files or a *.safetensors.index.json, or "
        "Hugging Face's *.bin files or their *.bin.index.json.")


def _json(file: Path, raw: bytes | str, said: str) -> Any:
    """JSON from a checkpoint's file (a header, an index): anything `json` refuses, nesting past
    its recursion included, is a ValueError naming the file and saying `said`."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"checkpoint: {str(file)!r} is not {said} "
                         f"({type(e).__name__}: {str(e)[:200]}).") from e


def _small_text(file: Path, what: str) -> str:
    """A JSON file beside a checkpoint (an index, an adapter's config), refused past
    `MAX_HEADER` bytes before it is read."""
    size = _size(file)
    if size > MAX_HEADER:
        raise ValueError(f"checkpoint: {str(file)!r} is not {what}: it holds {size} bytes, and "
                         f"this reads such files up to {MAX_HEADER}.")
    return file.read_bytes().decode("utf-8", errors="replace")


def adapter_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The `adapter_config.json` of a PEFT adapter at `path` (its directory, or a file in it),
    None where there is none: its tensors are adapter weights of a base model, for
    `PeftModel.from_pretrained`, not a state dict of the model.

    Raises:
        ValueError: for an `adapter_config.json` that is not a JSON object.
    """
    where = Path(path)
    try:
        folder = where if where.is_dir() else where.parent
        file = folder / "adapter_config.json"
        if not _present(file):
            return None
        config = _json(file, _small_text(file, "a PEFT adapter's config"),
                       "a PEFT adapter's config: not JSON")
    except OSError as e:
        raise ValueError(f"checkpoint: {str(e.filename or path)!r} cannot be read "
                         f"({type(e).__name__}: {e.strerror or e}).") from e
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint: {str(file)!r} is not a PEFT adapter's config: a JSON "
                         f"{type(config).__name__}, not an object.")
    return config


# -- DCP ----------------------------------------------------------------------------------------

#: the classes DCP's `.metadata` pickle names (torch 2.x): each read as a stand-in that keeps the
#: state pickled for it, so that neither the file's code nor these classes' own runs
_DCP_CLASSES = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})


def _layout(name: object) -> object:
    """`torch.serialization._get_layout`: a layout by its name ("torch.strided")."""
    value = vars(torch).get(name.rpartition(".")[2]) if isinstance(name, str) else None
    return value if isinstance(value, torch.layout) else _StandIn()


def _dtype(module: str, name: str) -> torch.dtype | None:
    """`torch.<dtype>` as a pickle names it (read from torch's namespace, never imported)."""
    value = vars(torch).get(name) if module == "torch" else None
    return value if isinstance(value, torch.dtype) else None


class _DCPMetadata(pickle.Unpickler):
    """Reads DCP's `.metadata` as `FileSystemReader.read_metadata` does (a pickle), each of DCP's
    metadata classes a stand-in of that name holding its pickled state (`_Named`), dtypes,
    layouts and sizes as themselves, and any other name a plain stand-in: no code runs."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return _DCP_STANDINS[(module, name)]
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        dtype = _dtype(module, name)
        return _StandIn if dtype is None else dtype


def _dcp_metadata(directory: Path) -> tuple[_Named, Mapping[Any, Any]]:
    """DCP's `Metadata` (a stand-in) and its entries, by flattened key."""
    file = directory / ".metadata"
    size = _size(file)
    with file.open("rb") as f:
        try:
            metadata = pickles.load(_DCPMetadata, f, size)
        except _UNREADABLE as e:
            raise ValueError(f"checkpoint: {str(file)!r} is not DCP metadata this reads "
                             f"({_why(e)}).") from e
    entries = metadata.field("state_dict_metadata") if _is(metadata, "Metadata") else None
    if not isinstance(entries, Mapping):
        raise ValueError(f"checkpoint: {str(file)!r} is not DCP metadata: it holds "
                         f"{_described(metadata)}, not torch.distributed.checkpoint's Metadata "
                         "of a state dict.")
    return metadata, entries


def _dcp(directory: Path) -> dict[str, Saved]:
    file = directory / ".metadata"
    _, entries = _dcp_metadata(directory)
    out = {}
    for key, item in entries.items():
        if _is(item, "BytesStorageMetadata"):
            continue
        saved = _dcp_tensor(item)
        if saved is None or not isinstance(key, str):
            raise ValueError(
                f"checkpoint: {str(file)!r} is not DCP metadata this reads: its entry "
                f"{_key(key)!r} is {_described(item)}, not a tensor's metadata (a dtype and a "
                "size) nor bytes'.")
        out[key] = saved
    return out


#: the largest object a DCP checkpoint saved as bytes (a number, a list) that is read
MAX_DCP_OBJECT = 1 << 20


def dcp_objects(directory: Path, wanted: Callable[[list[str]], list[str]]) -> dict[str, Any]:
    """The objects (not tensors) a DCP checkpoint saved as bytes, by flattened key: the keys
    `wanted` picks of those it holds (a schedule's `step`, `phase`, ...), each read from its
    byte range of a data file (`torch.save` bytes, read as `torch_save_record` reads a file).
    A key whose bytes a storage extension transformed (compressed), or that are larger than
    `MAX_DCP_OBJECT`, is left out.

    Raises:
        ValueError: naming the file, for metadata or bytes this cannot read.
    """
    metadata, entries = _dcp_metadata(directory)
    keys = wanted([k for k, v in entries.items() if isinstance(k, str)
                   and _is(v, "BytesStorageMetadata")])
    storage = metadata.field("storage_data")
    where: dict[str, _Named] = {}
    for index, info in storage.items() if isinstance(storage, Mapping) else ():
        fqn = index.field("fqn") if _is(index, "MetadataIndex") else None
        if fqn in keys and _is(info, "_StorageInfo"):
            where[fqn] = info
    out = {}
    for key, info in where.items():
        span = _dcp_span(info)
        if span is None:
            continue
        file = directory / span[0]
        with file.open("rb") as f:
            f.seek(span[1])
            data = f.read(span[2])
        if len(data) == span[2]:
            out[key] = _zip_record(file, io.BytesIO(data), span[2])
    return out


def _dcp_span(info: _Named) -> tuple[str, int, int] | None:
    """Where a `_StorageInfo` says its bytes are: (a data file in the checkpoint's directory,
    offset, length); None for bytes an extension transformed, or longer than
    `MAX_DCP_OBJECT`."""
    path, offset, length = (info.field(n) for n in ("relative_path", "offset", "length"))
    if (info.field("transform_descriptors") or not isinstance(path, str)
            or Path(path).name != path or not isinstance(offset, int)
            or not isinstance(length, int) or not 0 < length <= MAX_DCP_OBJECT):
        return None
    return path, offset, length


def _dcp_tensor(item: object) -> Saved | None:
    """A `TensorStorageMetadata`'s dtype (its properties' first field, as `TensorProperties`
    pickles itself, or a field by name) and size; None for anything else."""
    if not _is(item, "TensorStorageMetadata"):
        return None
    properties = item.field("properties")
    state = properties.state if _is(properties, "TensorProperties") else None
    dtype = (state[0] if isinstance(state, tuple) and state else
             state.get("dtype") if isinstance(state, Mapping) else None)
    shape = _shape(item.field("size"))
    return Saved(dtype, shape) if isinstance(dtype, torch.dtype) and shape is not None else None


def _is(value: object, name: str) -> TypeGuard[_Named]:
    return isinstance(value, _Named) and value.named[1] == name


def _described(value: object) -> str:
    if isinstance(value, _Named):
        return f"a {'.'.join(value.named)}"
    if isinstance(value, _StandIn):
        return "an object of a class other than DCP's"
    return f"a {type(value).__name__}"


# -- safetensors ---------------------------------------------------------------------------------

#: the bits of one element of each dtype the safetensors format names (`Dtype::bitsize` of its
#: reader): any other name is one safetensors refuses
SAFETENSORS_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64,
}


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors header, with the bytes its header says it spans."""

    saved: Saved
    begin: int
    end: int
    bits: int  # its elements' bits, all together


def _safetensors(file: Path) -> dict[str, Saved]:
    """The header of a safetensors file (8 bytes of little-endian length, then JSON), checked
    as safetensors checks it before it loads a tensor: each entry's dtype, shape and
    `data_offsets`, the tensors' bytes tiling the data after the header exactly."""
    size = _size(file)
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file (too short).")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise ValueError(
                f"checkpoint: {str(file)!r} is not a safetensors file: its header length says "
                f"{length} bytes, and " + (
                    f"the file holds {size - 8} after it" if length > size - 8 else
                    f"safetensors refuses headers over {MAX_HEADER} bytes") + " (a corrupt or "
                "truncated file).")
        raw = f.read(length)
    header = _json(file, raw, "a safetensors file: its header is not JSON")
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file: its header is "
                         f"a JSON {type(header).__name__}, not an object of tensors.")
    _metadata(file, header.get("__metadata__"))
    entries = {key: _entry(file, key, item) for key, item in header.items()
               if key != "__metadata__"}
    _tiled(file, entries, size - 8 - length)
    return {key: entry.saved for key, entry in entries.items()}


def _not_safetensors(file: Path, said: str) -> ValueError:
    return ValueError(f"checkpoint: {str(file)!r} is not a safetensors file: {said}; "
                      "safetensors refuses to load it too.")


def _metadata(file: Path, metadata: object) -> None:
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise _not_safetensors(file, "its header's '__metadata__' is not an object of strings")


def _sizes(value: object, length: int | None = None) -> tuple[int, ...] | None:
    """A JSON list of sizes (non-negative integers, `length` of them where given)."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        return None
    return tuple(value)


def _entry(file: Path, key: str, item: object) -> _Entry:
    """One tensor of a safetensors header: {"dtype": "BF16", "shape": [..], "data_offsets":
    [begin, end]}."""
    fields = item if isinstance(item, dict) else {}
    dtype, shape = fields.get("dtype"), _sizes(fields.get("shape"))
    offsets = _sizes(fields.get("data_offsets"), 2)
    if not (isinstance(dtype, str) and shape is not None and offsets is not None):
        raise _not_safetensors(
            file, f"its header's entry {key!r} is not a tensor's (an object with a 'dtype' name, "
            "a 'shape' list of sizes and 'data_offsets' [begin, end], non-negative integers). "
            f"Received: {str(item)[:200]}")
    if dtype not in SAFETENSORS_BITS:
        raise _not_safetensors(
            file, f"its header's entry {key!r} has dtype {dtype!r}, none of safetensors' "
            f"({', '.join(SAFETENSORS_BITS)})")
    count = 1
    for n in shape:  # stops growing past any file's size (a shape of 2^40 x 2^40)
        count = min(count * n, 1 << 64)
    return _Entry(Saved(SAFETENSORS_DTYPES.get(dtype), shape), offsets[0], offsets[1],
                  count * SAFETENSORS_BITS[dtype])


def _tiled(file: Path, entries: Mapping[str, _Entry], data: int) -> None:
    """The tensors' byte ranges, in order, tile the `data` bytes after the header: each starts
    where the one before ends, ends at or after it starts, spans its elements' bytes, and the
    last ends at the end of the file (safetensors' `Metadata::validate` and its check of the
    buffer's length)."""
    start = 0
    for key, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        span = f"its header's entry {key!r} spans bytes [{entry.begin}, {entry.end}]"
        if entry.end < entry.begin:
            raise _not_safetensors(file, f"{span}: it ends before it begins")
        if entry.begin != start:
            raise _not_safetensors(file, f"{span}, and the tensor before it ends at {start}: "
                                   "tensors " + ("overlap" if entry.begin < start else
                                                 "leave a gap"))
        if entry.bits % 8 or entry.bits // 8 != entry.end - entry.begin:
            raise _not_safetensors(
                file, f"{span} ({entry.end - entry.begin} bytes), and its dtype and shape "
                f"{list(entry.saved.shape)} take {entry.bits} bits")
        start = entry.end
    if start != data:
        raise _not_safetensors(
            file, f"its tensors end at byte {start} of its data, and the file holds {data} "
            "bytes after the header (" + ("truncated" if start > data else "bytes no tensor "
                                          "covers") + ")")


def _index(index: Path) -> dict[str, Saved]:
    """The shards an index names, each header read once."""
    data = _json(index, _small_text(index, "a checkpoint index"),
                 "a checkpoint index: not JSON")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"checkpoint: {str(index)!r} is not a checkpoint index: it needs a 'weight_map' "
            "object of tensor names to shard files, as save_pretrained writes it.")
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not _present(index.parent / s)]
    if absent:
        raise ValueError(
            f"checkpoint: the index {str(index)!r} names {len(absent)} of its {len(shards)} "
            f"shard file(s) that are not beside it ({', '.join(map(repr, absent[:6]))}"
            f"{', ...' if len(absent) > 6 else ''}): a load of it fails too. Copy every shard "
            "next to the index.")
    out: dict[str, Saved] = {}
    for shard in shards:  # safetensors shards, or torch.save ones (pytorch_model-*.bin)
        out.update(_file(index.parent / shard))
    return {k: out[k] for k in weight_map if k in out}


# -- torch.save ----------------------------------------------------------------------------------

class _Storage:
    """A storage `torch.save` names: its dtype (its bytes are never read)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:
        pass


class _Tensor:
    """A tensor as the pickle builds it; `Saved` once read (the pickle cannot set it up)."""

    __slots__ = ("saved",)

    def __init__(self, saved: Saved) -> None:
        self.saved = saved

    def __setstate__(self, state: Any) -> None:
        pass


class _StandIn:
    """Whatever a checkpoint's pickle names other than tensors and containers: a class (so that
    pickle may build it, by call or by `__new__`), its instances holding the state pickle sets
    them up with (a module's `__dict__`, kept, not copied: one state may be shared by a million
    of them) and the items pickle puts in them (a dict subclass's), hashed and compared by
    identity."""

    __slots__ = ("items", "state")
    items: dict[Any, Any]
    state: Any

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        self = super().__new__(cls)
        self.items, self.state = {}, None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def field(self, name: str) -> Any:
        """A field of its state: of the dict pickled for it, or of the dict of a (dict, slots)
        pair."""
        parts = self.state if isinstance(self.state, tuple) else (self.state,)
        return next((part[name] for part in parts if isinstance(part, Mapping)
                     and name in part), None)

    def children(self) -> Iterator[tuple[Any, Any]]:
        """Its items, then its state's fields."""
        yield from self.items.items()
        for part in self.state if isinstance(self.state, tuple) else (self.state,):
            if isinstance(part, Mapping):
                yield from part.items()


class _Named(_StandIn):
    """A stand-in for a class DCP's metadata names (`named`)."""

    __slots__ = ()
    named: tuple[str, str] = ("", "")


_DCP_STANDINS: dict[tuple[str, str], type[_Named]] = {
    key: type(key[1], (_Named,), {"__slots__": (), "named": key}) for key in _DCP_CLASSES}


class _Dict(dict):  # type: ignore[type-arg]
    """An `OrderedDict` (a state dict): its items; the attributes pickled beside them
    (`_metadata`) are dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _shape(size: Any) -> tuple[int, ...] | None:
    """A pickled size (a tuple, list or `torch.Size`) as sizes, None unless it is one."""
    if isinstance(size, (tuple, list)) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size):
        return tuple(size)
    return None


def _tensor(dtype: Any, size: Any) -> Any:
    """A tensor of this dtype and size as the reader sees it; a stand-in for anything else."""
    shape = _shape(size)
    ok = isinstance(dtype, torch.dtype) and shape is not None
    return _Tensor(Saved(dtype, shape)) if ok else _StandIn()  # type: ignore[arg-type]


def _rebuilt(storage: Any, offset: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch._utils._rebuild_tensor_v2` and its kin (quantized tensors too): the storage's
    dtype."""
    return _tensor(storage.dtype, size) if isinstance(storage, _Storage) else _StandIn()


def _rebuilt_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, *args: Any) -> Any:
    """`_rebuild_tensor_v3`: an untyped storage, the dtype given (fp8, uint16, ...)."""
    return _tensor(dtype, size)


def _rebuilt_without_storage(dtype: Any, size: Any, *args: Any) -> Any:
    """`_rebuild_meta_tensor_no_storage`: a meta tensor."""
    return _tensor(dtype, size)


def _rebuilt_subclass(cls: Any, dtype: Any, size: Any, *args: Any) -> Any:
    """`_rebuild_wrapper_subclass`: a tensor subclass (torchao's fp8 weights, DTensor) by the
    dtype and shape it presents."""
    return _tensor(dtype, size)


def _rebuilt_on_device(data: Any, dtype: Any, *args: Any) -> Any:
    """`_rebuild_device_tensor_from_cpu_tensor`: a tensor saved through a CPU copy."""
    return _tensor(dtype, data.saved.shape) if isinstance(data, _Tensor) else _StandIn()


def _rebuilt_parameter(data: Any, *args: Any) -> Any:
    return data


def _rebuilt_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """`torch._tensor._rebuild_from_type_v2`: a subclass or a tensor with attributes, rebuilt by
    `func` (one of the builders here, or a stand-in)."""
    return func(*args) if isinstance(args, tuple) else _StandIn()


_TENSOR_BUILDERS: dict[str, Callable[..., Any]] = {
    "_rebuild_tensor_v2": _rebuilt, "_rebuild_tensor": _rebuilt, "_rebuild_qtensor": _rebuilt,
    "_rebuild_tensor_v3": _rebuilt_v3,
    "_rebuild_meta_tensor_no_storage": _rebuilt_without_storage,
    "_rebuild_wrapper_subclass": _rebuilt_subclass,
    "_rebuild_device_tensor_from_cpu_tensor": _rebuilt_on_device,
    "_rebuild_parameter": _rebuilt_parameter,
    "_rebuild_parameter_with_state": _rebuilt_parameter,
    "_rebuild_from_type_v2": _rebuilt_from_type, "_rebuild_from_type": _rebuilt_from_type,
}
_SAFE_BUILTINS: dict[str, Any] = {"set": set, "frozenset": frozenset}


class _Records(pickle.Unpickler):
    """Reads a `torch.save` pickle without running it: tensors become `Saved`, storages their
    dtype, containers are themselves, and every other name a stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch._utils", "torch._tensor") and name in _TENSOR_BUILDERS:
            return _TENSOR_BUILDERS[name]
        if module == "collections" and name == "OrderedDict":
            return _Dict
        if module in ("builtins", "__builtin__") and name in _SAFE_BUILTINS:  # (protocol 2)
            return _SAFE_BUILTINS[name]
        if module == "torch" and name.endswith("Storage"):
            return _storage_dtype(name)
        if module == "torch" and name == "Size":
            return tuple
        dtype = _dtype(module, name)
        return _StandIn if dtype is None else dtype

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, numel[, view]): the type gives the dtype;
        # ("module", class, ...) in a legacy file: the class, a stand-in here
        kind = pid[1] if isinstance(pid, tuple) and len(pid) > 1 else None
        return _Storage(kind) if isinstance(kind, torch.dtype) else _StandIn


def _storage_dtype(name: str) -> Any:
    """The dtype of a storage class `torch.save` names ("BFloat16Storage"); `UntypedStorage`
    holds bytes.

    NOTE: torch's own map from storage class names to dtypes (`serialization.StorageType`),
    as `torch.load` reads them."""
    if name == "UntypedStorage":
        return torch.uint8
    try:
        return torch.serialization.StorageType(name).dtype  # type: ignore[no-untyped-call]
    except (KeyError, AttributeError):
        return _StandIn


#: what a pickle this cannot read raises while read by the stand-in unpicklers (`pickles.Refused`
#: is a ValueError; a stand-in built or set up with what it cannot take raises TypeError, ...)
_UNREADABLE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
               IndexError, KeyError, ImportError, OverflowError, zipfile.BadZipFile,
               RecursionError, struct.error)
#: `torch.save`'s legacy format starts with this number, pickled (`serialization.MAGIC_NUMBER`)
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
#: the characters of keys a pickle may flatten to, per byte of it: a state dict spells each key
#: out (about 1), a whole pickled module shares its names' parts (a few); far more is one object
#: reached under very many names
KEY_CHARS_PER_BYTE = 16


def _why(e: BaseException) -> str:
    """Why a pickle was refused: the walk's own words, or the exception `pickle` raised."""
    said = str(e)[:300]
    return said if isinstance(e, pickles.Refused) else f"{type(e).__name__}: {said}"


def _torch_save(file: Path) -> dict[str, Saved]:
    return _flatten(file, torch_save_record(file), KEY_CHARS_PER_BYTE * _size(file) + (1 << 20))


def torch_save_record(file: Path) -> Any:
    """The object a `torch.save` file holds, read from its pickle record alone: tensors as
    stand-ins holding their `Saved`, containers, numbers and strings as themselves, any other
    class a stand-in (no storage is read, no code of the file runs).

    Raises:
        ValueError: naming the file, for one that is not a `torch.save` file this reads.
    """
    size = _size(file)
    with file.open("rb") as f:
        if zipfile.is_zipfile(f):
            record = _zip_record(file, f, size)
        else:
            f.seek(0)
            head = f.read(32)  # a pickle (PROTO), or protocol 0-1's magic number as text
            if not (head.startswith(b"\x80") or head.startswith(b"L%d" % _LEGACY_MAGIC)):
                raise ValueError(
                    f"checkpoint: {str(file)!r} is neither a DCP directory, safetensors, nor a "
                    "file torch.save writes (a zip file, or a pickle in its legacy format).")
            f.seek(0)
            record = _legacy_record(file, f, size)
    return record


#: the bytes read from a zip member at a time
_CHUNK = 1 << 20


def _zip_record(file: Path, f: IO[bytes], size: int) -> Any:
    """The object of a `torch.save` zip file's `data.pkl`, read in chunks up to the size its
    header declares, after that size is checked against the file's: `torch.save` stores its
    records uncompressed, so a record declared larger than the whole file is a zip bomb (or a
    corrupt header)."""
    try:
        with zipfile.ZipFile(f) as archive:
            records = [i for i in archive.infolist()
                       if i.filename.endswith("data.pkl") and i.filename.count("/") == 1]
            if not records:
                raise ValueError(f"checkpoint: {str(file)!r} is a zip file, but not one "
                                 "torch.save wrote (no data.pkl record).")
            if records[0].file_size > size:
                raise ValueError(
                    f"checkpoint: {str(file)!r} is a zip file whose record "
                    f"{records[0].filename!r} declares {records[0].file_size} bytes, more than "
                    f"the {size} of the whole file (a zip bomb, or a corrupt archive: "
                    "torch.save stores its records uncompressed).")
            with archive.open(records[0]) as member:
                chunks = iter(lambda: member.read(_CHUNK), b"")
                data = b"".join(chunks)
        return pickles.loads(_Records, data)
    except _UNREADABLE as e:
        if str(e).startswith("checkpoint:"):
            raise
        raise ValueError(f"checkpoint: {str(file)!r} is a zip file whose torch.save record "
                         f"cannot be read ({_why(e)}).") from e


def _legacy_record(file: Path, f: IO[bytes], size: int) -> Any:
    """The object of a legacy `torch.save` file: after its magic number, protocol version and
    system info, before the storages' keys and data (never read)."""
    try:
        if pickles.load(_Records, f, size) != _LEGACY_MAGIC:
            raise ValueError("it does not start with torch.save's magic number")
        pickles.load(_Records, f, size)  # protocol version
        pickles.load(_Records, f, size)  # system info
        return pickles.load(_Records, f, size)
    except _UNREADABLE as e:
        raise ValueError(f"checkpoint: {str(file)!r} is a pickle, but not a file torch.save "
                         f"wrote in its legacy format ({_why(e)}).") from e


def _named_optimizer_state(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """An optimizer's `state_dict()` whose groups name their parameters (`param_names`, as
    torch keeps them for an optimizer given named parameters): its state keyed by name."""
    groups, state = value.get("param_groups"), value.get("state")
    if not (isinstance(groups, list) and isinstance(state, Mapping)):
        return value
    names: dict[int, str] = {}
    for group in groups:
        ids = group.get("params") if isinstance(group, Mapping) else None
        given = group.get("param_names") if isinstance(group, Mapping) else None
        if not (isinstance(ids, list) and isinstance(given, list) and len(ids) == len(given)
                and all(type(i) is int for i in ids) and all(isinstance(n, str) for n in given)):
            return value
        names.update(zip(ids, given, strict=True))
    return {**value, "state": {names.get(k, k) if type(k) is int else k: v
                               for k, v in state.items()}}


def _key(key: Any) -> str:
    """A key as a name: strings and numbers as themselves, anything else by its type (never
    printed: a pickled tuple may share its parts a million times over)."""
    if isinstance(key, str):
        return key
    if isinstance(key, (bool, float)) or (isinstance(key, int) and key.bit_length() <= 64):
        return str(key)
    return f"<{type(key).__name__}>"


def _children(value: Any) -> Iterator[tuple[str, Any]] | None:
    """What a container holds, by name: a pickled module's state dict, a stand-in's items and
    state, a mapping's items, a list's or tuple's items by index; None for anything else."""
    if isinstance(value, _StandIn):
        if value.field("_parameters") is not None and value.field("_modules") is not None:
            return _module(value)
        return ((_key(k), v) for k, v in value.children())
    if isinstance(value, Mapping):
        return ((_key(k), v) for k, v in _named_optimizer_state(value).items())
    if isinstance(value, (list, tuple)):
        return ((str(i), v) for i, v in enumerate(value))
    return None


def _flatten(file: Path, root: Any, budget: int) -> dict[str, Saved]:
    """Every tensor under `root` by its dotted key, each container visited once however often
    it is shared (a pickle may reach one list by 2^40 paths), without recursion, the keys'
    characters bounded by `budget`."""
    out: dict[str, Saved] = {}
    seen: dict[int, Any] = {}  # held, so that an id is not reused while read
    stack: list[tuple[str, Iterator[tuple[str, Any]]]] = []
    spent = 0
    pending: list[tuple[str, Any]] = [("", root)]
    while pending:
        prefix, value = pending.pop()
        if isinstance(value, _Tensor):
            out[prefix] = value.saved
        elif id(value) not in seen and (children := _children(value)) is not None:
            seen[id(value)] = value
            stack.append((prefix, children))
        while stack and not pending:
            prefix, children = stack[-1]
            item = next(children, None)
            if item is None:
                stack.pop()
                continue
            name = f"{prefix}.{item[0]}" if prefix else item[0]
            spent += len(name)
            if spent > budget:
                raise ValueError(
                    f"checkpoint: {str(file)!r} flattens to keys of more than {budget} "
                    f"characters, {KEY_CHARS_PER_BYTE} a byte of the file: its objects are "
                    "reached under more names than any checkpoint's.")
            pending.append((name, item[1]))
    return out


def _module(module: _StandIn) -> Iterator[tuple[str, Any]]:
    """A whole `nn.Module` pickled (`torch.save(model)`): its state dict's tensors, by the names
    `model.state_dict()` gives them (its non-persistent buffers left out), then its children."""
    skip = module.field("_non_persistent_buffers_set")
    skip = skip if isinstance(skip, (set, frozenset)) else set()
    for group in ("_parameters", "_buffers"):
        tensors = module.field(group)
        for name, tensor in tensors.items() if isinstance(tensors, Mapping) else ():
            if isinstance(tensor, _Tensor) and not (group == "_buffers" and name in skip):
                yield _key(name), tensor
    children = module.field("_modules")
    for name, child in children.items() if isinstance(children, Mapping) else ():
        yield _key(name), child
