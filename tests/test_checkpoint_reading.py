"""What `check(..., "checkpoint")` reads of a checkpoint, tried with the files users have and the
files that break readers: every dtype safetensors and `torch.save` write, tensor subclasses, a
whole pickled module, the legacy `torch.save` format, corrupt headers and indexes, pickles that
would run code, and small files built to hang, crash or exhaust a reader (each refused by name
within a time and memory bound). Each is judged against what torch, safetensors and DCP
themselves load."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import struct
import time
import tracemalloc
import warnings
import zipfile
import zlib
from collections.abc import Iterator
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


@pytest.mark.parametrize("protocol", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_pickle_protocol_torch_save_writes_is_read_as_torch_load_reads_it(
        tmp_path: Path, protocol: int, legacy: bool) -> None:
    """The walk that bounds a pickle before it is read knows every opcode: text ones (protocol
    1), frames (4, 5), sets, big integers; 0.5 refused a legacy file of protocol 1 (its magic
    number is text)."""
    model = applied()
    state = {"model": model.state_dict(), "step": 3, "names": ("a", "b"), "lr": 0.1,
             "big": 2**70, "flag": True, "ids": {1, 2}}
    for name, value in (("state", state), ("module", model)):
        file = tmp_path / f"{name}.pt"
        torch.save(value, file, pickle_protocol=protocol,
                   _use_new_zipfile_serialization=not legacy)
        torch.load(file, weights_only=False)  # torch reads it
        want = read(model) if name == "module" else {f"model.{k}": v
                                                    for k, v in read(model).items()}
        assert saved_tensors(file) == want, name


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


# -- hostile files: refused by name, in time and memory bounded by their size ------------------

@contextlib.contextmanager
def bounded(seconds: float, mib: float) -> Iterator[None]:
    """The block runs in under `seconds` (an alarm stops it, so that a reader that would run
    for hours fails instead) and allocates at most `mib` MiB at its peak (tracemalloc sees every
    allocation Python makes, pickle's and zlib's included)."""
    def stop(*_: object) -> None:
        raise TimeoutError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert took < seconds and peak < mib * 2**20, (took, peak / 2**20)


def zipped(file: Path, record: bytes) -> Path:
    """A zip file as torch.save writes one, holding `record` as its data.pkl."""
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr(f"{file.stem}/data.pkl", record)
    return file


def zip_bomb(file: Path, size: int) -> Path:
    """A zip whose data.pkl is a valid pickle of `size` zero bytes, deflated to about 1 MiB:
    16 MiB of zeros compressed once and repeated (each piece ends in a full flush, so the pieces
    join into one stream), its CRC right, so that any reader inflates it whole."""
    chunk, prefix, count = bytes(1 << 24), b"\x80\x04\x8e" + struct.pack("<Q", size), size >> 24
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = deflate.compress(prefix) + deflate.flush(zlib.Z_FULL_FLUSH)
    piece = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    data = first + piece * count + deflate.compress(b".") + deflate.flush()
    crc = zlib.crc32(prefix)
    for _ in range(count):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(b".", crc)
    name, full = f"{file.stem}/data.pkl".encode(), len(prefix) + size + 1
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0, crc, len(data), full,
                        len(name), 0) + name
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 8, 0, 0, crc, len(data),
                          full, len(name), 0, 0, 0, 0, 0, 0) + name
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central),
                      len(local) + len(data), 0)
    file.write_bytes(local + data + central + end)
    return file


def shared(levels: int, leaf: Any) -> Any:
    """A graph of `levels` levels, each holding the one below twice: 2^levels paths to `leaf`
    in a pickle of a few bytes a level (the memo)."""
    node = leaf
    for _ in range(levels):
        node = [node, node]
    return node


BINBYTES8_2_40 = b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"abc."


def hostile(tmp_path: Path, name: str) -> Path:
    """Files that hung 0.5's reader, crashed it with a raw exception or grew it past 1 GiB."""
    file = tmp_path / f"{name}.pt"
    if name == "shared-lists":  # 0.5: busy past 60 s (2^40 paths); torch.load: at once
        torch.save(shared(40, []), file)
    elif name == "shared-tuple-key":  # hashing it walks 2^40 nodes; 0.5: did not end
        record = b"\x80\x02}N" + b"".join(b"\x94h%c\x86" % i for i in range(40)) + b"K\x01s."
        zipped(file, record)
    elif name == "self-reference":  # 0.5: RecursionError
        loop: list[Any] = []
        loop.append(loop)
        torch.save({"a": loop}, file)
    elif name == "deep-tuple-key":  # a key nested 10^6 deep: 0.5 crashed (SIGSEGV) hashing it
        zipped(file, b"\x80\x02}N" + b"\x85" * 10**6 + b"K\x01s.")
    elif name == "declared-2^40":  # 0.5: MemoryError
        zipped(file, BINBYTES8_2_40)
    elif name == "legacy-declared-2^40":  # the legacy format: 0.5: MemoryError
        file.write_bytes(BINBYTES8_2_40)
    elif name == "memo-slot-2^30":  # pickle would write 2^31 memo slots (16 GiB)
        zipped(file, b"\x80\x02}r\xff\xff\xff\x3f.")
    elif name == "zip-bomb":  # 1 MiB inflating to 1 GiB: 0.5 reached 3.3 GiB of memory
        zip_bomb(file, 2**30)
    return file


@pytest.mark.parametrize("name", ["shared-lists", "self-reference"])
def test_shared_and_cyclic_objects_are_read_once_as_torch_load_reads_them(
        tmp_path: Path, name: str) -> None:
    file = hostile(tmp_path, name)
    torch.load(file, weights_only=True)  # torch reads these, at once
    with bounded(seconds=5, mib=16):
        assert saved_tensors(file) == {}
    found = check(applied(), "checkpoint", {"path": file})
    assert [f.code for f in found] == ["checkpoint-foreign"]


def test_a_tensor_reached_by_2_40_paths_is_read_once_under_its_first(tmp_path: Path) -> None:
    node: Any = {"w": torch.zeros(2, dtype=bf16)}
    for _ in range(40):
        node = {"a": node, "b": node}
    torch.save(node, tmp_path / "graph.pt")
    with bounded(seconds=5, mib=16):
        got = saved_tensors(tmp_path / "graph.pt")
    assert got == {".".join(["a"] * 40 + ["w"]): Saved(bf16, (2,))}


@pytest.mark.parametrize("name", [
    "shared-tuple-key", "deep-tuple-key", "declared-2^40", "legacy-declared-2^40",
    "memo-slot-2^30", "zip-bomb"])
def test_a_hostile_pickle_is_a_value_error_naming_it_in_bounded_time_and_memory(
        tmp_path: Path, name: str) -> None:
    file = hostile(tmp_path, name)
    with bounded(seconds=5, mib=16), pytest.raises(ValueError) as refused:
        saved_tensors(file)
    assert str(refused.value).startswith(f"checkpoint: {str(file)!r} ")


def test_no_payload_runs_in_a_hostile_pickle(tmp_path: Path) -> None:
    """A payload beside each kind of hostile record: the reader refuses or reads, never runs it."""
    payload = pickle.dumps(Payload(tmp_path / "ran"), protocol=2)[2:-1]  # its opcodes alone
    for i, record in enumerate([
            b"\x80\x02(" + payload + b"\x8e" + struct.pack("<Q", 2**40) + b"l.",
            b"\x80\x02(" + payload + b"N" + b"\x85" * 2000 + b"l.",
            b"\x80\x02(" + payload + b"]\x94h\x00a\x94l.",
            b"\x80\x02(" + payload + b"l."]):
        with contextlib.suppress(ValueError):
            saved_tensors(zipped(tmp_path / f"p{i}.pt", record))
    assert not (tmp_path / "ran").exists()


def test_a_shard_that_cannot_be_read_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """A symlink loop as a shard: 0.4 raised OSError (the CLI: exit status 3, a traceback)."""
    from safetensors.torch import save_file

    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "a.safetensors").symlink_to("b.safetensors")
    (tmp_path / "loop" / "b.safetensors").symlink_to("a.safetensors")
    with pytest.raises(ValueError, match=r"a.safetensors' cannot be read \(OSError: Too many "
                                         r"levels of symbolic links\)"):
        saved_tensors(tmp_path / "loop")
    (tmp_path / "indexed").mkdir()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "indexed" / "one.safetensors"))
    (tmp_path / "indexed" / "two.safetensors").symlink_to("two.safetensors")
    (tmp_path / "indexed" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    with pytest.raises(ValueError, match=r"two.safetensors' cannot be read"):
        saved_tensors(tmp_path / "indexed")
    os.mkfifo(tmp_path / "fifo.safetensors")  # opened, it would block until written to
    with bounded(seconds=5, mib=16), pytest.raises(ValueError, match="is not a regular file"):
        saved_tensors(tmp_path / "fifo.safetensors")


def dcp_metadata(tmp_path: Path, name: str, raw: bytes) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / ".metadata").write_bytes(raw)
    return tmp_path / name


def test_hostile_dcp_metadata_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """0.4: AttributeError (an entry whose properties are not TensorProperties) and
    MemoryError (a declared 2^40-byte record); DCP's own classes never run (a stand-in for each
    keeps the state pickled for it)."""
    from torch.distributed.checkpoint.metadata import (
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    def entry(properties: Any, size: Any) -> bytes:
        return pickle.dumps(Metadata(state_dict_metadata={"w": TensorStorageMetadata(
            properties=properties, size=size, chunks=[])}))

    real = entry(TensorProperties(dtype=bf16), torch.Size([2, 3]))
    assert saved_tensors(dcp_metadata(tmp_path, "real", real)) == {"w": Saved(bf16, (2, 3))}
    for name, raw in {"no-properties": entry(None, torch.Size([2])),
                      "no-size": entry(TensorProperties(dtype=bf16), "2 x 3"),
                      "declared": BINBYTES8_2_40,
                      "shared": pickle.dumps(Metadata(state_dict_metadata=shared(40, 1))),
                      "deep": b"\x80\x02}N" + b"\x85" * 10**6 + b"K\x01s."}.items():
        directory = dcp_metadata(tmp_path, name, raw)
        with bounded(seconds=5, mib=16), pytest.raises(ValueError) as refused:
            saved_tensors(directory)
        assert str(refused.value).startswith(
            f"checkpoint: {str(directory / '.metadata')!r} is not DCP metadata"), name


# -- safetensors' own checks of a header -------------------------------------------------------

def safetensors_file(file: Path, header: dict[str, Any], data: int) -> Path:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return file


def f32(begin: int, end: int, *shape: int) -> dict[str, Any]:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, end]}


@pytest.mark.parametrize(("header", "data", "said"), [
    ({"a": f32(0, 8, 2), "b": f32(4, 12, 2)}, 12, "the tensor before it ends at 8: tensors "
                                                 "overlap"),
    ({"a": f32(-8, 0, 2)}, 8, "is not a tensor's"),
    ({"a": f32(0, 8, 2)}, 4, "its tensors end at byte 8 of its data, and the file holds 4"),
    ({"a": f32(8, 0, 0), "b": f32(0, 8, 2)}, 8, "spans bytes [8, 0]: it ends before it begins"),
    ({"a": {"dtype": "F32", "shape": [2]}}, 8, "is not a tensor's"),
    ({"a": f32(4, 8, 1)}, 8, "the tensor before it ends at 0: tensors leave a gap"),
    ({"a": f32(0, 8, 2)}, 12, "bytes no tensor covers"),
    ({"a": f32(0, 8, 3)}, 8, "its dtype and shape [3] take 96 bits"),
    ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, "take 12 bits"),
    ({"a": {"dtype": "C128", "shape": [1], "data_offsets": [0, 16]}}, 16, "has dtype 'C128'"),
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, 1, "not a tensor's"),
    ({"__metadata__": {"x": 1}, "a": f32(0, 4, 1)}, 4, "'__metadata__' is not an object of "
                                                     "strings"),
], ids=["overlapping", "negative", "past-the-end", "end-before-begin", "no-data_offsets", "gap",
        "trailing-bytes", "wrong-size", "half-a-byte", "unknown-dtype", "bool-offsets",
        "metadata"])
def test_a_safetensors_file_safetensors_refuses_is_refused(
        tmp_path: Path, header: dict[str, Any], data: int, said: str) -> None:
    """0.5 read the dtype and shape alone and called the first five clean; safetensors refuses
    every one of them."""
    from safetensors import SafetensorError, safe_open

    file = safetensors_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(SafetensorError), safe_open(str(file), "pt") as f:
        list(f.keys())
    with pytest.raises(ValueError, match="is not a safetensors file") as refused:
        saved_tensors(file)
    assert said in str(refused.value) and str(file) in str(refused.value)


@pytest.mark.parametrize(("header", "data"), [
    ({"b": f32(8, 12, 1), "a": f32(0, 8, 2), "e": f32(12, 12, 0), "z": f32(12, 12, 0, 5)}, 12),
    ({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
      "b": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [2, 5]}}, 5),
    ({}, 0), ({"__metadata__": {"format": "pt"}, "a": f32(0, 4, 1)}, 4),
    ({"a": f32(0, 2**31 * 4, 2**31)}, 2**31 * 4),  # 8 GiB of data: a hole, never read
], ids=["unordered-and-empty", "sub-byte", "no-tensor", "metadata", "8-GiB"])
def test_a_safetensors_file_safetensors_reads_is_read(
        tmp_path: Path, header: dict[str, Any], data: int) -> None:
    from safetensors import safe_open

    raw = json.dumps(header).encode()
    file = tmp_path / "ok.safetensors"
    with file.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + data)  # sparse: the file takes no disk
    with safe_open(str(file), "pt") as f:
        keys = sorted(f.keys())
    with bounded(seconds=5, mib=16):
        got = saved_tensors(file)
    assert sorted(got) == keys
