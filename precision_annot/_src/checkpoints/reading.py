"""What a checkpoint holds, read without its tensor data: each tensor's dtype and shape, by key.

- `torch.distributed.checkpoint`: a directory with a `.metadata` file, read as DCP's own reader
  reads it but with only DCP's metadata classes allowed (no other code of the file runs).
- safetensors: a `.safetensors` file (its JSON header), a `*.safetensors.index.json` index of
  shards, or a directory holding either (Hugging Face's `save_pretrained`); a directory of
  `pytorch_model*.bin` files (or their `*.bin.index.json`), read as `torch.save` files.
- `torch.save`: a zip file, read from its pickle record alone (`data.pkl`), or a file in the
  legacy format (`_use_new_zipfile_serialization=False`), read from its pickles before the
  storages: tensors are seen by their dtype and shape (tensor subclasses such as torchao's by
  the dtype and shape they present), no storage is read and no code of the file runs (any class
  it names is a stand-in), so a Lightning checkpoint reads as a plain one and a whole pickled
  `nn.Module` as its state dict.

Nested dictionaries are flattened with ".", as DCP flattens them: `{"model": {"fc.weight": t}}`
reads as `"model.fc.weight"`. Whatever the path holds that this cannot read is a `ValueError`
naming the file and what was expected.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

__all__ = ["MAX_HEADER", "Saved", "saved_tensors"]


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
    """Every tensor a checkpoint at `path` holds, by its flattened key, read without its data.

    Raises:
        ValueError: for a path that holds no checkpoint this reads, naming what it looks for,
            or a file that is not the checkpoint its name says (a corrupt header, an index
            naming shards that are not there).
    """
    where = Path(path)
    if where.is_dir():
        return _directory(where, path)
    if not where.is_file():
        raise ValueError(f"checkpoint: no file or directory at {str(path)!r}.")
    if where.name.endswith(".index.json"):
        return _index(where)
    return _file(where)


def _file(where: Path) -> dict[str, Saved]:
    return _safetensors(where) if where.suffix == ".safetensors" else _torch_save(where)


def _directory(where: Path, path: str | os.PathLike[str]) -> dict[str, Saved]:
    if (where / ".metadata").is_file():
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


# -- DCP ----------------------------------------------------------------------------------------

#: the classes DCP's `.metadata` pickle names (torch 2.x), the only ones it is read with
_DCP_CLASSES = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})


def _layout(name: object) -> object:
    """`torch.serialization._get_layout`: a layout by its name ("torch.strided")."""
    value = getattr(torch, str(name).rpartition(".")[2], None)
    return value if isinstance(value, torch.layout) else _StandIn()


class _DCPMetadata(pickle.Unpickler):
    """Reads DCP's `.metadata` as `FileSystemReader.read_metadata` does (a pickle), with DCP's
    metadata classes, dtypes, sizes and layouts only: any other name is a stand-in, so a
    `.metadata` that names code does not run it.

    NOTE: DCP's metadata classes are imported by name, private ones (`_StorageInfo`,
    `_MEM_FORMAT_ENCODING`) included, because they are what its pickle holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        return _StandIn


def _dcp(directory: Path) -> dict[str, Saved]:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    file = directory / ".metadata"
    try:
        with file.open("rb") as f:
            metadata = _DCPMetadata(f).load()
        items = metadata.state_dict_metadata.items() if isinstance(metadata, Metadata) else None
    except _UNREADABLE as e:
        raise ValueError(f"checkpoint: {str(file)!r} is not DCP metadata this reads "
                         f"({type(e).__name__}: {e}).") from e
    if items is None:
        raise ValueError(f"checkpoint: {str(file)!r} is not DCP metadata: it holds "
                         f"{type(metadata).__name__}, not torch.distributed.checkpoint's "
                         "Metadata.")
    return {key: Saved(item.properties.dtype, tuple(item.size)) for key, item in items
            if isinstance(item, TensorStorageMetadata)}


# -- safetensors ---------------------------------------------------------------------------------

def _safetensors(file: Path) -> dict[str, Saved]:
    """The header of a safetensors file: 8 bytes of little-endian length, then JSON."""
    size = file.stat().st_size
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
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file: its header "
                         f"is not JSON ({e}).") from e
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file: its header is "
                         f"a JSON {type(header).__name__}, not an object of tensors.")
    return {key: _entry(file, key, item) for key, item in header.items()
            if key != "__metadata__"}


def _entry(file: Path, key: str, item: object) -> Saved:
    """One tensor of a safetensors header: {"dtype": "BF16", "shape": [..], ...}."""
    shape = item.get("shape") if isinstance(item, dict) else None
    dtype = item.get("dtype") if isinstance(item, dict) else None
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
        raise ValueError(
            f"checkpoint: {str(file)!r} is not a safetensors file: its header's entry "
            f"{key!r} is not a tensor's (an object with a 'dtype' name and a 'shape' list of "
            f"sizes). Received: {str(item)[:200]}")
    return Saved(SAFETENSORS_DTYPES.get(dtype), tuple(shape))


def _index(index: Path) -> dict[str, Saved]:
    """The shards an index names, each header read once."""
    try:
        data = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"checkpoint: {str(index)!r} is not a checkpoint index: not JSON "
                         f"({e}).") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ValueError(
            f"checkpoint: {str(index)!r} is not a checkpoint index: it needs a 'weight_map' "
            "object of tensor names to shard files, as save_pretrained writes it.")
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not (index.parent / s).is_file()]
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

@dataclasses.dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype


class _StandIn(dict):  # type: ignore[type-arg]
    """Whatever a checkpoint's pickle names other than tensors and containers: a class (so that
    pickle may build it, by call or by `__new__`), its instances filled and set up as pickle
    asks, holding nothing but the state pickle gives them (a module's `__dict__`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    __hash__ = object.__hash__  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return self is other

    def __setstate__(self, state: Any) -> None:
        for part in state if isinstance(state, tuple) else (state,):  # (dict, slots)
            if isinstance(part, Mapping):
                self.update(part)

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Dict(dict):  # type: ignore[type-arg]
    """An `OrderedDict` (a state dict): its items; the attributes pickled beside them
    (`_metadata`) are dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _size(size: Any) -> tuple[int, ...]:
    return tuple(size) if isinstance(size, (tuple, list)) else ()


def _rebuilt(storage: Any, offset: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch._utils._rebuild_tensor_v2` and its kin (quantized tensors too): the storage's
    dtype."""
    return Saved(storage.dtype, _size(size)) if isinstance(storage, _Storage) else _StandIn()


def _rebuilt_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dtype: Any, *args: Any) -> Any:
    """`_rebuild_tensor_v3`: an untyped storage, the dtype given (fp8, uint16, ...)."""
    return Saved(dtype, _size(size)) if isinstance(dtype, torch.dtype) else _StandIn()


def _rebuilt_without_storage(dtype: Any, size: Any, *args: Any) -> Any:
    """`_rebuild_meta_tensor_no_storage`: a meta tensor."""
    return Saved(dtype, _size(size)) if isinstance(dtype, torch.dtype) else _StandIn()


def _rebuilt_subclass(cls: Any, dtype: Any, size: Any, *args: Any) -> Any:
    """`_rebuild_wrapper_subclass`: a tensor subclass (torchao's fp8 weights, DTensor) by the
    dtype and shape it presents."""
    return _rebuilt_without_storage(dtype, size)


def _rebuilt_on_device(data: Any, dtype: Any, *args: Any) -> Any:
    """`_rebuild_device_tensor_from_cpu_tensor`: a tensor saved through a CPU copy."""
    if isinstance(data, Saved) and isinstance(dtype, torch.dtype):
        return Saved(dtype, data.shape)
    return _StandIn()


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
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage"):
            return _storage_dtype(name)
        if module == "torch" and name == "Size":
            return tuple
        return _StandIn

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


#: what a pickle this cannot read raises while read by the stand-in unpicklers
_UNREADABLE = (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
               IndexError, KeyError, ImportError, zipfile.BadZipFile, RecursionError)
#: `torch.save`'s legacy format starts with this number, pickled (`serialization.MAGIC_NUMBER`)
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _torch_save(file: Path) -> dict[str, Saved]:
    if zipfile.is_zipfile(file):
        return dict(_flatten(_zip_record(file), ""))
    with file.open("rb") as f:
        if f.read(1) == b"\x80":  # a pickle: torch.save's legacy format
            f.seek(0)
            return dict(_flatten(_legacy_record(file, f), ""))
    raise ValueError(
        f"checkpoint: {str(file)!r} is neither a DCP directory, safetensors, nor a file "
        "torch.save writes (a zip file, or a pickle in its legacy format).")


def _zip_record(file: Path) -> Any:
    try:
        with zipfile.ZipFile(file) as archive:
            records = [n for n in archive.namelist()
                       if n.endswith("data.pkl") and n.count("/") == 1]
            if not records:
                raise ValueError(f"checkpoint: {str(file)!r} is a zip file, but not one "
                                 "torch.save wrote (no data.pkl record).")
            with archive.open(records[0]) as record:
                return _Records(record).load()
    except _UNREADABLE as e:
        if str(e).startswith("checkpoint:"):
            raise
        raise ValueError(f"checkpoint: {str(file)!r} is a zip file whose torch.save record "
                         f"cannot be read ({type(e).__name__}: {e}).") from e


def _legacy_record(file: Path, f: IO[bytes]) -> Any:
    """The object of a legacy `torch.save` file: after its magic number, protocol version and
    system info, before the storages' keys and data (never read)."""
    try:
        if _Records(f).load() != _LEGACY_MAGIC:
            raise ValueError("it does not start with torch.save's magic number")
        _Records(f).load()  # protocol version
        _Records(f).load()  # system info
        return _Records(f).load()
    except _UNREADABLE as e:
        raise ValueError(f"checkpoint: {str(file)!r} is a pickle, but not a file torch.save "
                         f"wrote in its legacy format ({type(e).__name__}: {e}).") from e


def _named_optimizer_state(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """An optimizer's `state_dict()` whose groups name their parameters (`param_names`, as
    torch keeps them for an optimizer given named parameters): its state keyed by name."""
    groups, state = value.get("param_groups"), value.get("state")
    if not (isinstance(groups, list) and isinstance(state, Mapping)):
        return value
    names: dict[Any, str] = {}
    for group in groups:
        if not isinstance(group, Mapping):
            return value
        ids, given = group.get("params"), group.get("param_names")
        if not (isinstance(ids, list) and isinstance(given, list) and len(ids) == len(given)):
            return value
        names.update(zip(ids, given, strict=True))
    return {**value, "state": {names.get(k, k): v for k, v in state.items()}}


def _flatten(value: Any, prefix: str) -> Iterator[tuple[str, Saved]]:
    if isinstance(value, Saved):
        yield prefix, value
    elif isinstance(value, _StandIn) and "_parameters" in value and "_modules" in value:
        yield from _module(value, prefix)
    elif isinstance(value, Mapping):
        value = _named_optimizer_state(value)
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}.{i}" if prefix else str(i))


def _module(module: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Saved]]:
    """A whole `nn.Module` pickled (`torch.save(model)`): its state dict's tensors, by the names
    `model.state_dict()` gives them (its non-persistent buffers left out)."""
    skip = module.get("_non_persistent_buffers_set")
    skip = skip if isinstance(skip, (set, frozenset)) else set()
    dot = f"{prefix}." if prefix else ""
    for group in ("_parameters", "_buffers"):
        tensors = module.get(group)
        for name, tensor in tensors.items() if isinstance(tensors, Mapping) else ():
            if isinstance(tensor, Saved) and not (group == "_buffers" and name in skip):
                yield f"{dot}{name}", tensor
    children = module.get("_modules")
    for name, child in children.items() if isinstance(children, Mapping) else ():
        yield from _flatten(child, f"{dot}{name}")
