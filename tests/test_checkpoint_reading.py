"""What `check(..., "checkpoint")` reads of a checkpoint, tried with the files users have and the
files that break readers: every dtype safetensors and `torch.save` write, tensor subclasses, a
whole pickled module, the legacy `torch.save` format, corrupt headers and indexes, and pickles
that would run code. Each is judged against what torch, safetensors and DCP themselves load."""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from precision_annot import apply, bf16, check, fp32, precision
from precision_annot._src.checkpoints.reading import MAX_HEADER, Saved, saved_tensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Net(nn.Module):
    """A bf16 model with an fp32 norm, a BatchNorm's statistics and a non-persistent table."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.norm = precision(fp32)(nn.LayerNorm(16))
        self.register_buffer("table", torch.arange(4.0), persistent=False)


def applied() -> nn.Module:
    return apply(Net(), default="bf16-true")


def read(model: nn.Module) -> dict[str, Saved]:
    """What a state dict holds, as the reader should see it."""
    return {k: Saved(v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}


# -- safetensors -------------------------------------------------------------------------------

def test_every_dtype_safetensors_writes_is_read_as_safetensors_loads_it(tmp_path: Path) -> None:
    """0.4 dropped U16/U32/U64, F8_E8M0 and the FNUZ formats: a model tensor saved in one of
    them was reported missing."""
    from safetensors.torch import load_file, save_file

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
              torch.float8_e8m0fnu, torch.complex64, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool]
    tensors = {str(d): torch.zeros(2, 3).to(d) for d in dtypes}
    save_file(tensors, str(tmp_path / "all.safetensors"))
    loaded = load_file(str(tmp_path / "all.safetensors"))
    assert saved_tensors(tmp_path / "all.safetensors") == {
        k: Saved(v.dtype, tuple(v.shape)) for k, v in loaded.items()}


def header(length: int, text: bytes) -> bytes:
    return struct.pack("<Q", length) + text


@pytest.mark.parametrize(("raw", "said"), [
    (header(2**62, b"{}"), "header length says 4611686018427387904 bytes, and the file holds 2"),
    (header(2**33, b"{}"), "header length says 8589934592 bytes, and the file holds 2"),
    (header(100, b'{"a": {"dtype": "F32"}}'), "header length says 100 bytes"),
    (header(7, b"[1, 2] "), "its header is a JSON list"),
    (header(8, b'{"a": 1}'), "its header's entry 'a' is not a tensor's"),
    (header(23, b'{"a": {"dtype": "F32"}}'), "its header's entry 'a' is not a tensor's"),
    (header(4, b"\xff\xfe{}"), "its header is not JSON"),
    (b"abc", "too short"),
])
def test_a_corrupt_safetensors_header_is_refused_without_reading_past_it(
        tmp_path: Path, raw: bytes, said: str) -> None:
    """0.4 asked Python for the header length the file claims (2^62: MemoryError; 2^33 over a
    small file: read to its end and found no tensor), and indexed the header unchecked
    (TypeError, KeyError). safetensors refuses each of these files too."""
    from safetensors import SafetensorError, safe_open

    file = tmp_path / "bad.safetensors"
    file.write_bytes(raw)
    with pytest.raises(ValueError, match="is not a safetensors file") as refused:
        saved_tensors(file)
    assert said in str(refused.value)
    with pytest.raises((SafetensorError, OSError, ValueError)), safe_open(str(file), "pt") as f:
        list(f.keys())


def test_a_header_safetensors_refuses_for_its_size_is_not_read(tmp_path: Path) -> None:
    file = tmp_path / "big.safetensors"
    with file.open("wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER + 1))
        f.truncate(MAX_HEADER + 16)  # sparse: the length fits the file, not safetensors
    with pytest.raises(ValueError, match=f"refuses headers over {MAX_HEADER} bytes"):
        saved_tensors(file)


def test_an_index_naming_absent_or_no_shards_is_refused_naming_them(tmp_path: Path) -> None:
    """0.4: FileNotFoundError (exit status 3 from the CLI), KeyError, TypeError."""
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors",
                                                "c": "three.safetensors"}}))
    with pytest.raises(ValueError, match=r"names 2 of its 3 shard file\(s\) that are not beside "
                                         r"it \('three.safetensors', 'two.safetensors'\)"):
        saved_tensors(tmp_path)
    for text in ("{}", "[1, 2]", '{"weight_map": {"a": 1}}'):
        index.write_text(text)
        with pytest.raises(ValueError, match="needs a 'weight_map' object"):
            saved_tensors(index)
    index.write_text("not json")
    with pytest.raises(ValueError, match="is not a checkpoint index: not JSON"):
        saved_tensors(index)


# -- torch.save --------------------------------------------------------------------------------

def test_torch_save_tensors_of_every_dtype_and_kind_are_read_as_torch_load_builds_them(
        tmp_path: Path) -> None:
    """0.4 dropped tensors `torch.save` writes through `_rebuild_tensor_v3` (fp8, uint16, ...)
    and `torch._tensor._rebuild_from_type_v2` (a tensor with attributes, tensor subclasses),
    and read a quantized tensor as nothing: each was reported missing."""
    tagged = torch.ones(3, dtype=bf16)
    tagged.note = "kept"  # type: ignore[attr-defined]  # pickled with its __dict__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.randn(4, 2), 0.1, 0, torch.qint8)
    state: dict[str, Any] = {
        **{str(d): torch.zeros(2, 3).to(d) for d in (
            torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.bool,
            torch.complex64, torch.float64, torch.int8)},
        "tagged": tagged, "quantized": quantized, "meta": torch.empty(5, 2, device="meta"),
        "parameter": nn.Parameter(torch.zeros(2, 2)), "view": torch.zeros(6)[2:5]}
    torch.save(state, tmp_path / "all.pt")
    loaded = torch.load(tmp_path / "all.pt", weights_only=True)
    assert saved_tensors(tmp_path / "all.pt") == {
        k: Saved(v.dtype, tuple(v.shape)) for k, v in loaded.items()}


def test_torchao_fp8_weights_are_read_by_the_dtype_they_present(tmp_path: Path) -> None:
    """An applied model whose Linear layers all-gather fp8 weights (comm=fp8) holds torchao's
    weight subclass: 0.4 failed on its pickle ("NEWOBJ class argument must be a type")."""
    pytest.importorskip("torchao")
    import precision_annot as pa

    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    pa.annotate(model, {nn.Linear: "compute=fp8,comm=fp8"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pa.apply(model, default="bf16-mixed")
    assert type(model[0].weight).__name__ != "Parameter"  # torchao's subclass
    torch.save(model.state_dict(), tmp_path / "fp8.pt")
    assert saved_tensors(tmp_path / "fp8.pt") == read(model)
    assert check(model, "checkpoint", {"path": tmp_path / "fp8.pt"}) == []


class Recorder(nn.Module):
    """A module whose unpickling has a side effect, as any class in a pickled model may."""

    built: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.inner = Net()

    def __setstate__(self, state: dict[str, Any]) -> None:
        Recorder.built.append("unpickled")
        super().__setstate__(state)


class Payload:
    """What a malicious checkpoint holds: unpickling it makes a directory."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.makedirs, (str(self.where),))


def test_a_whole_pickled_module_is_read_as_its_state_dict_and_runs_no_code(
        tmp_path: Path) -> None:
    """`torch.save(model)` (the old way, and what some trainers write): 0.4 failed on it. It
    reads as `model.state_dict()` would (the non-persistent table left out), and neither the
    module's own `__setstate__` nor a payload beside it runs, while `torch.load` runs both."""
    model = Recorder()
    apply(model, default="bf16-true")
    torch.save({"model": model, "extra": Payload(tmp_path / "ran")}, tmp_path / "whole.pt")
    got = saved_tensors(tmp_path / "whole.pt")
    assert got == {f"model.{k}": v for k, v in read(model).items()}
    assert check(model, "checkpoint", {"path": tmp_path / "whole.pt"}) == []
    assert Recorder.built == [] and not (tmp_path / "ran").exists()
    torch.load(tmp_path / "whole.pt", weights_only=False)  # what the payload does when run
    assert Recorder.built == ["unpickled"] and (tmp_path / "ran").is_dir()


def test_the_legacy_torch_save_format_is_read_without_its_storages(tmp_path: Path) -> None:
    """0.4 refused it, saying it could not be read without loading it: its pickles come
    before its storages, which are cut off here and never read."""
    model = applied()
    torch.save(model.state_dict(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert saved_tensors(tmp_path / "legacy.pt") == read(model)
    torch.save(model, tmp_path / "module.pt", _use_new_zipfile_serialization=False)
    assert saved_tensors(tmp_path / "module.pt") == read(model)
    raw = (tmp_path / "legacy.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[:-100])  # the last storages' data cut off
    with pytest.raises(Exception):  # noqa: B017  # torch cannot load it
        torch.load(tmp_path / "cut.pt", weights_only=True)
    assert saved_tensors(tmp_path / "cut.pt") == read(model)
    (tmp_path / "pickle.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="not a file torch.save wrote in its legacy format"):
        saved_tensors(tmp_path / "pickle.pt")


def test_a_corrupt_torch_save_file_is_refused_naming_it(tmp_path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(tmp_path / "z.pt", "w") as archive:
        archive.writestr("z/data.pkl", b"\x80\x02garbage")
    with pytest.raises(ValueError, match=r"z.pt' is a zip file whose torch.save record cannot "
                                         r"be read \(UnpicklingError"):
        saved_tensors(tmp_path / "z.pt")


# -- DCP ---------------------------------------------------------------------------------------

def test_dcp_metadata_is_read_with_dcps_classes_only(tmp_path: Path) -> None:
    """DCP's reader unpickles `.metadata` with pickle itself: a `.metadata` that names code runs
    it. The check reads DCP's own classes only: a real checkpoint reads as before, a payload is
    refused without running, garbage is a ValueError (0.4: UnpicklingError)."""
    model = applied()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ok"))
    assert saved_tensors(tmp_path / "ok") == {f"model.{k}": v for k, v in read(model).items()}
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(ValueError, match="is not DCP metadata: it holds"):
        saved_tensors(tmp_path / "evil")
    assert not (tmp_path / "ran").exists()
    (tmp_path / "evil" / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="is not DCP metadata this reads"):
        saved_tensors(tmp_path / "evil")


def test_dcp_data_without_its_metadata_is_said_to_be_an_unfinished_save(tmp_path: Path) -> None:
    dcp.save(applied().state_dict(), checkpoint_id=str(tmp_path))
    (tmp_path / ".metadata").unlink()
    with pytest.raises(ValueError, match=r"holds DCP data files \(\*.distcp\) but no .metadata"):
        check(applied(), "checkpoint", {"path": tmp_path})


def test_a_hugging_face_checkpoint_of_bin_shards_is_read_by_its_index(tmp_path: Path) -> None:
    """The layout of checkpoints older transformers saved (and many on the hub hold):
    `pytorch_model-0000N-of-0000M.bin` torch.save shards and `pytorch_model.bin.index.json`, or
    one `pytorch_model.bin`. 0.4 refused the directory ("without a checkpoint this reads")."""
    model = applied()
    state = model.state_dict()
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[:4],
              "pytorch_model-00002-of-00002.bin": names[4:]}
    (tmp_path / "sharded").mkdir()
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / "sharded" / shard)
    (tmp_path / "sharded" / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    (tmp_path / "single").mkdir()
    torch.save(state, tmp_path / "single" / "pytorch_model.bin")
    for where in ("sharded", "single"):
        assert saved_tensors(tmp_path / where) == read(model), where
        assert check(model, "checkpoint", {"path": tmp_path / where}) == [], where
