"""What a checkpoint holds, read without its tensor data: each tensor's dtype and shape, by key.

- `torch.distributed.checkpoint`: a directory with a `.metadata` file (DCP's own reader).
- safetensors: a `.safetensors` file (its JSON header), a `*.safetensors.index.json` index of
  shards, or a directory holding either (Hugging Face's `save_pretrained`).
- `torch.save`: a zip file, read from its pickle record alone (`data.pkl`): tensors are seen by
  their storage's dtype and their shape, no storage record is read and no code of the file
  runs (any class it names is a stand-in), so a Lightning checkpoint reads as a plain one.

Nested dictionaries are flattened with ".", as DCP flattens them: `{"model": {"fc.weight": t}}`
reads as `"model.fc.weight"`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["Saved", "saved_tensors"]


@dataclasses.dataclass(frozen=True)
class Saved:
    """One tensor a checkpoint holds: its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


#: safetensors' dtype names (its header's "dtype")
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def saved_tensors(path: str | os.PathLike[str]) -> dict[str, Saved]:
    """Every tensor a checkpoint at `path` holds, by its flattened key, read without its data.

    Raises:
        ValueError: for a path that holds no checkpoint this reads, naming what it looks for.
    """
    where = Path(path)
    if where.is_dir():
        if (where / ".metadata").is_file():
            return _dcp(where)
        indexes = sorted(where.glob("*.safetensors.index.json"))
        if indexes:
            return _safetensors_index(indexes[0])
        files = sorted(where.glob("*.safetensors"))
        if files:
            return {k: v for f in files for k, v in _safetensors(f).items()}
        raise ValueError(
            f"checkpoint: {str(path)!r} is a directory without a checkpoint this reads: a DCP "
            "checkpoint (a .metadata file), *.safetensors files or a *.safetensors.index.json.")
    if not where.is_file():
        raise ValueError(f"checkpoint: no file or directory at {str(path)!r}.")
    if where.name.endswith(".index.json"):
        return _safetensors_index(where)
    if where.suffix == ".safetensors":
        return _safetensors(where)
    return _torch_save(where)


# -- DCP ----------------------------------------------------------------------------------------

def _dcp(directory: Path) -> dict[str, Saved]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata()
    return {key: Saved(item.properties.dtype, tuple(item.size))
            for key, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)}


# -- safetensors ---------------------------------------------------------------------------------

def _safetensors(file: Path) -> dict[str, Saved]:
    """The header of a safetensors file: 8 bytes of little-endian length, then JSON."""
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file (too short).")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"checkpoint: {str(file)!r} is not a safetensors file: its header "
                             f"is not JSON ({e}).") from e
    out = {}
    for key, item in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(item["dtype"])
        if dtype is not None:
            out[key] = Saved(dtype, tuple(item["shape"]))
    return out


def _safetensors_index(index: Path) -> dict[str, Saved]:
    """The shards an index names, each header read once."""
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    out: dict[str, Saved] = {}
    for shard in sorted(set(weight_map.values())):
        out.update(_safetensors(index.parent / shard))
    return {k: out[k] for k in weight_map if k in out}


# -- torch.save ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype


class _StandIn(dict):  # type: ignore[type-arg]
    """Whatever a checkpoint's pickle names other than tensors and containers: built, filled
    and set up as pickle asks, holding nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, Mapping):
            self.update(state)

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Dict(dict):  # type: ignore[type-arg]
    """An `OrderedDict` (a state dict): its items; the attributes pickled beside them
    (`_metadata`) are dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _stand_in(*args: Any, **kwargs: Any) -> _StandIn:
    return _StandIn()


def _rebuilt(storage: Any, offset: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
    """`torch._utils._rebuild_tensor_v2` and its kin, seen as what they would build."""
    if isinstance(storage, _Storage):
        return Saved(storage.dtype, tuple(size))
    return _StandIn()


def _rebuilt_parameter(data: Any, *args: Any) -> Any:
    return data


def _rebuilt_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    return func(*args)


_TENSOR_BUILDERS = {"_rebuild_tensor_v2": _rebuilt, "_rebuild_tensor": _rebuilt,
                    "_rebuild_parameter": _rebuilt_parameter,
                    "_rebuild_parameter_with_state": _rebuilt_parameter,
                    "_rebuild_from_type_v2": _rebuilt_from_type}


class _Records(pickle.Unpickler):
    """Reads a `torch.save` pickle without running it: tensors become `Saved`, storages their
    dtype, containers are themselves, and every other name a stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in _TENSOR_BUILDERS:
            return _TENSOR_BUILDERS[name]
        if module == "collections" and name == "OrderedDict":
            return _Dict
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name.endswith("Storage"):
            return _storage_dtype(name)
        if module == "torch" and name == "Size":
            return tuple
        return _stand_in

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, numel): the type gives the dtype
        kind = pid[1] if isinstance(pid, tuple) and len(pid) > 1 else None
        return _Storage(kind) if isinstance(kind, torch.dtype) else _StandIn()


def _storage_dtype(name: str) -> torch.dtype | Any:
    """The dtype of a storage class `torch.save` names ("BFloat16Storage"); `UntypedStorage`
    holds bytes.

    NOTE: torch's own map from storage class names to dtypes (`serialization.StorageType`),
    as `torch.load` reads them."""
    if name == "UntypedStorage":
        return torch.uint8
    try:
        return torch.serialization.StorageType(name).dtype  # type: ignore[no-untyped-call]
    except (KeyError, AttributeError):
        return _stand_in


def _torch_save(file: Path) -> dict[str, Saved]:
    if not zipfile.is_zipfile(file):
        raise ValueError(
            f"checkpoint: {str(file)!r} is neither a DCP directory, safetensors, nor a zip-format "
            "torch.save file (torch.save writes zip files since torch 1.6; a legacy file cannot "
            "be read without loading it).")
    with zipfile.ZipFile(file) as archive:
        records = [n for n in archive.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if not records:
            raise ValueError(f"checkpoint: {str(file)!r} is a zip file, but not one torch.save "
                             "wrote (no data.pkl record).")
        root = _Records(archive.open(records[0])).load()
    return dict(_flatten(root, ""))


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
    elif isinstance(value, Mapping):
        value = _named_optimizer_state(value)
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flatten(item, f"{prefix}.{i}" if prefix else str(i))
