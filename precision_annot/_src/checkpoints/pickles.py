"""A pickle read without running it, in work and memory bounded by its size.

`pickle` trusts the lengths and indexes a pickle declares: a `BINBYTES8` of 2^40 bytes is
allocated before a byte of it is read (a `MemoryError`), a `LONG_BINPUT` of index 2^30 grows the
memo to that many slots (gigabytes, written), and a tuple nested a million deep crashes the
interpreter when it is hashed as a dict key (one shared 40 levels down takes 2^40 steps). So each
pickle is first walked opcode by opcode (`_walk`, which builds nothing), and refused where a length
runs past the bytes that are there, a memo slot is past the pickle's bytes so far, objects nest
deeper than `MAX_DEPTH`, or what it hashes adds up to more than `HASHED_PER_BYTE` nodes a byte.
Only then does `pickle.Unpickler` (the caller's subclass, whose `find_class` decides what each
name becomes) read the bytes the walk found, and nothing past them.
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from collections.abc import Callable
from typing import IO, Any

__all__ = ["HASHED_PER_BYTE", "MAX_DEPTH", "Refused", "load", "loads"]

#: how deep objects may nest (a list in a dict in ...): a module tree pickled whole nests about
#: three levels per module; a hash of a tuple nested about 10^5 deep overflows the C stack
MAX_DEPTH = 1000


class Refused(ValueError):
    """A pickle declares more than it holds, or nests or hashes more than any checkpoint's."""


#: what is read of a file at first, while looking for a pickle's end (then twice as much)
_FIRST_READ = 1 << 16

# What each opcode does to the stack (`_Walk.ops`), by its name.
_MAKE, _PUT, _GET, _MARK, _POP, _POP_MARK, _DUP, _MUTATE, _NOTHING, _STOP = range(10)
_EFFECTS = {"PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _PUT, "GET": _GET,
            "BINGET": _GET, "LONG_BINGET": _GET, "MARK": _MARK, "POP": _POP,
            "POP_MARK": _POP_MARK, "DUP": _DUP, "APPEND": _MUTATE, "APPENDS": _MUTATE,
            "SETITEM": _MUTATE, "SETITEMS": _MUTATE, "ADDITEMS": _MUTATE, "BUILD": _MUTATE,
            "PROTO": _NOTHING, "FRAME": _NOTHING, "STOP": _STOP}
# How each opcode's argument is laid out: a fixed number of bytes (>= 0), one or two lines, or a
# length of 1, 4 (signed or not) or 8 bytes and that many bytes; None for a byte no opcode has.
_LINE, _TWO_LINES, _COUNT1, _COUNT4, _COUNT4U, _COUNT8U = -1, -2, -3, -4, -5, -6
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: _COUNT1, pickletools.TAKEN_FROM_ARGUMENT4: _COUNT4,
            pickletools.TAKEN_FROM_ARGUMENT4U: _COUNT4U,
            pickletools.TAKEN_FROM_ARGUMENT8U: _COUNT8U}
_PREFIX = {_COUNT1: (1, False), _COUNT4: (4, True), _COUNT4U: (4, False), _COUNT8U: (8, False)}


def _layout(op: pickletools.OpcodeInfo) -> int:
    if op.arg is None:
        return 0
    if op.arg.n >= 0:
        return op.arg.n
    if op.arg.n == pickletools.UP_TO_NEWLINE:
        return _TWO_LINES if op.arg.name == "stringnl_noescape_pair" else _LINE
    return _COUNTED[op.arg.n]


#: what `pickle` hashes of the items an opcode pops: the keys of a dict's items, all of a set's
#: items, all of a call's (its callable may be `set`)
_KEYS, _ALL = slice(0, None, 2), slice(None)
_HASHES = {"SETITEM": _KEYS, "SETITEMS": _KEYS, "DICT": _KEYS, "ADDITEMS": _ALL,
           "FROZENSET": _ALL, "REDUCE": _ALL, "NEWOBJ": _ALL, "NEWOBJ_EX": _ALL, "OBJ": _ALL,
           "INST": _ALL}

_LAYOUTS: list[int | None] = [None] * 256
#: by opcode: its effect, how many objects it pops (a MARK counted), whether down to a mark,
#: and what of them it hashes
_STEPS: list[tuple[int, int, bool, slice | None]] = [(_NOTHING, 0, False, None)] * 256
for _op in pickletools.opcodes:
    _code = ord(_op.code)
    _LAYOUTS[_code] = _layout(_op)
    _STEPS[_code] = (_EFFECTS.get(_op.name, _MAKE), len(_op.stack_before),
                     pickletools.markobject in _op.stack_before, _HASHES.get(_op.name))
#: opcodes whose argument the walk reads: memo slots, and a frame's length
_READ_ARG = frozenset(ord(c) for c in "pqrghj\x95")
#: what may be hashed, per byte of a pickle: a key or a call's arguments take a few bytes each
HASHED_PER_BYTE = 16


class _Short(Exception):  # a signal, not an error
    """The walk needs bytes past those read so far."""


class _Walk:
    """What each object a pickle builds would cost, opcode by opcode, as `pickle` would build it:
    each object on the stack is a cell [depth, size] (its nesting, and its nodes counted as often
    as they are reached), shared where the object is (the memo, `DUP`), so that a list filled
    after it was memoized is as deep and large as its items made it.

    What `pickle` hashes (a dict's keys, a set's items, a call's arguments, which may be `set`'s)
    costs its size: a tuple hashes every node it reaches, and one tuple reaching itself twice per
    level, 40 levels down, is 2^40 nodes in a few hundred bytes. The sizes hashed add up to at
    most `budget`; nothing nests deeper than `MAX_DEPTH` (a hash recurses as deep).

    `ops[code](arg, at)` is the opcode `code` at byte `at` (True at STOP): a table, one small
    method per kind of opcode, since it runs once per opcode."""

    def __init__(self) -> None:
        self.stack: list[list[int]] = []
        self.marks: list[int] = []
        self.memo: dict[int, list[int]] = {}
        self.budget = 1 << 16
        kinds: dict[int, Callable[[int, int], bool]] = {
            _PUT: self.put, _GET: self.get, _MARK: self.mark, _POP: self.pop,
            _POP_MARK: self.pop_mark, _DUP: self.dup, _NOTHING: self.nothing, _STOP: self.stop}
        self.ops: list[Callable[[int, int], bool]] = []
        for code, (effect, pops, marked, hashes) in enumerate(_STEPS):
            op: Callable[[int, int], bool]
            if effect == _MAKE:
                op = functools.partial(self.make, pops, marked, hashes) if pops else self.push
            elif effect == _MUTATE:
                op = functools.partial(self.mutate, pops - 1, marked, hashes)
            else:
                op = self.memoize if code == 0x94 else kinds[effect]
            self.ops.append(op)

    def push(self, arg: int, at: int) -> bool:
        self.stack.append([0, 1])
        return False

    def make(self, pops: int, marked: bool, hashes: slice | None, arg: int, at: int) -> bool:
        """An object made of those the opcode pops (a tuple of them, a call's result)."""
        cell = [0, 1]
        self.grow(cell, self.popped(pops, marked), hashes)
        self.stack.append(cell)
        return False

    def mutate(self, pops: int, marked: bool, hashes: slice | None, arg: int, at: int) -> bool:
        """The object under those the opcode pops takes them (appended, set, its state)."""
        items = self.popped(pops, marked)
        self.grow(self.stack[-1], items, hashes)
        return False

    def put(self, arg: int, at: int) -> bool:
        if arg > at:  # each opcode takes a byte: a slot past them is no memo's
            raise Refused(f"it names memo slot {arg} at byte {at} (pickle would make that "
                          "many slots)")
        self.memo[arg] = self.stack[-1]
        return False

    def memoize(self, arg: int, at: int) -> bool:
        self.memo[len(self.memo)] = self.stack[-1]
        return False

    def get(self, arg: int, at: int) -> bool:
        self.stack.append(self.memo[arg])
        return False

    def mark(self, arg: int, at: int) -> bool:
        self.marks.append(len(self.stack))
        return False

    def dup(self, arg: int, at: int) -> bool:
        self.stack.append(self.stack[-1])
        return False

    def pop_mark(self, arg: int, at: int) -> bool:
        del self.stack[self.marks.pop():]
        return False

    def pop(self, arg: int, at: int) -> bool:
        if len(self.stack) > (self.marks[-1] if self.marks else 0):
            self.stack.pop()
        else:  # nothing above the last mark: the mark
            self.marks.pop()
        return False

    def stop(self, arg: int, at: int) -> bool:
        self.stack.pop()
        return True

    def nothing(self, arg: int, at: int) -> bool:
        return False

    def popped(self, count: int, marked: bool) -> list[list[int]]:
        stack = self.stack
        at = self.marks.pop() if marked else len(stack) - count
        if at < 0 or (not marked and self.marks and at < self.marks[-1]):
            raise IndexError("pop past the stack")
        items = stack[at:]
        del stack[at:]
        return items

    def grow(self, cell: list[int], items: list[list[int]], hashes: slice | None) -> None:
        """`cell` holds `items` now; what is hashed of them is charged."""
        depth, size = cell
        for item in items:
            if item[0] >= depth:
                depth = item[0] + 1
            size += item[1]
        if hashes is not None:
            self.budget -= sum(item[1] for item in items[hashes])
            if self.budget < 0:
                raise Refused("its keys reach objects shared under more names than any "
                              "checkpoint's (hashing them would not end)")
        if depth > MAX_DEPTH:
            raise Refused(f"its objects nest more than {MAX_DEPTH} deep")
        cell[0], cell[1] = depth, min(size, self.budget + 1)  # past the budget: as good as any


def _end_of_arg(data: bytes, start: int, layout: int, whole: bool) -> int:
    """Where an argument laid out as `layout` ends (a line, or a counted run of bytes); past
    the end of `data` where it runs past it and more may come."""
    if layout in (_LINE, _TWO_LINES):
        end = data.find(b"\n", start) + 1
        end = data.find(b"\n", end) + 1 if end and layout == _TWO_LINES else end
        if not end and whole:
            raise pickle.UnpicklingError("a line runs past its end")
        return end or len(data) + 1
    size, signed = _PREFIX[layout]
    count = int.from_bytes(data[start:start + size], "little", signed=signed)
    left = len(data) - start - size
    if whole and (left < 0 or count < 0 or count > left):
        raise Refused(f"it declares {count} bytes where {max(left, 0)} are left")
    return start + size + count


def _arg(data: bytes, start: int, end: int, layout: int) -> int:
    """The number a memo or frame opcode names (binary, or a decimal line)."""
    if layout != _LINE:
        return int.from_bytes(data[start:end], "little")
    text = data[start:end - 1]
    if not text.isdigit() or len(text) > 19:
        raise pickle.UnpicklingError(f"a memo slot that is no number: {text[:40]!r}")
    return int(text)


def _walk(walk: _Walk, data: bytes, at: int, whole: bool) -> int:
    """Where the pickle `walk` has walked up to byte `at` of `data` ends (after its STOP),
    refused where it declares more than is there, names a memo slot past its bytes, or nests or
    hashes too much; `whole` says that `data` is all there is (else an opcode running past it
    asks for more: `_Short`, with `walk` as it was after the last whole opcode)."""
    end, layouts, read_arg, ops = len(data), _LAYOUTS, _READ_ARG, walk.ops
    while True:
        if at >= end:
            raise pickle.UnpicklingError("it ends before its STOP") if whole else _Short(at)
        code = data[at]
        layout = layouts[code]
        if layout is None:
            raise pickle.UnpicklingError(f"no opcode is byte {code:#04x} (at {at})")
        after = at + 1 + layout if layout >= 0 else _end_of_arg(data, at + 1, layout, whole)
        if after > end:
            raise pickle.UnpicklingError("it ends inside an opcode") if whole else _Short(at)
        arg = (data[at + 1] if layout == 1 else _arg(data, at + 1, after, layout)
               ) if code in read_arg else 0
        if code == 0x95 and arg > end - after:  # FRAME: its length
            raise Refused(f"it declares a frame of {arg} bytes where {end - after} are left"
                          ) if whole else _Short(at)
        if ops[code](arg, at):
            return after
        at = after


def _walked(walk: _Walk, data: bytes, at: int, whole: bool) -> int:
    try:
        return _walk(walk, data, at, whole)
    except (IndexError, KeyError) as e:  # popped what is not there: no pickle at all
        raise pickle.UnpicklingError(f"invalid opcode sequence ({type(e).__name__})") from e


def _pickle_bytes(f: IO[bytes], end: int) -> bytes:
    """The bytes of the pickle at `f`'s position, walked; `f` is left after them. What is read
    doubles until the walk finds the pickle's end (a legacy `torch.save` file's storages after
    it are never read), the walk going on from the last whole opcode."""
    start, walk, at, data = f.tell(), _Walk(), 0, b""
    while True:
        more = f.read(min(max(len(data), _FIRST_READ), end - start - len(data)))
        data += more
        walk.budget += HASHED_PER_BYTE * len(more)
        try:
            stop = _walked(walk, data, at, start + len(data) >= end)
        except _Short as short:
            at = short.args[0]
            continue
        f.seek(start + stop)
        return data[:stop]


def load(unpickler: type[pickle.Unpickler], f: IO[bytes], end: int) -> Any:
    """The object of the pickle at `f`'s position (ending by `end`), read by `unpickler` after
    the walk above found nothing it refuses; `f` is left after the pickle.

    Raises:
        Refused: for a pickle that declares more than `end` leaves, or nests too deep.
        pickle.UnpicklingError, ValueError, ...: for bytes that are no pickle (as `pickle`
            raises them).
    """
    return unpickler(io.BytesIO(_pickle_bytes(f, end))).load()


def loads(unpickler: type[pickle.Unpickler], data: bytes) -> Any:
    """As `load`, for a pickle that is all of `data`."""
    walk = _Walk()
    walk.budget += HASHED_PER_BYTE * len(data)
    return unpickler(io.BytesIO(data[:_walked(walk, data, 0, True)])).load()
