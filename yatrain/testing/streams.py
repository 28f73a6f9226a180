"""Fake ``torch.cuda`` streams and events on the CPU that check how work is ordered.

The engine's CUDA path (one communication stream, ordered against the compute stream by
events only: ``yatrain/sharding/comm.py``) needs a GPU to run, and there a missing
``wait_event`` is a race that corrupts numbers only now and then. Here every op still runs
at once on the CPU, but it is attributed to the fake stream current at the time, and a
vector clock per stream (advanced by each op, merged by each ``wait_event``) says which work
of other streams is guaranteed to have run before it. Every storage an op reads or writes
is checked against the earlier accesses of other streams:

- a read of data another stream wrote must come after that write;
- a write must come after other streams' earlier reads and writes; so must a free, since
  the caching allocator hands freed memory to the next allocation on the stream that
  allocated it (the engine uses no ``record_stream``);
- a wait must name an event that was recorded (on a GPU it would silently wait for nothing).

The device is taken to lag forever: ``Event.query`` answers "not yet", so only waits order
work; the host learns what a stream has done only when it synchronises (``item()``,
``synchronize``), and work it queues after that comes after it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

Clock = dict[str, int]  # stream name -> the last of its ops known to have run


def _merge(into: Clock, other: Clock) -> None:
    for name, tick in other.items():
        if into.get(name, 0) < tick:
            into[name] = tick


@dataclass
class Access:
    stream: str
    tick: int  # the op's number on its stream
    what: str


@dataclass
class BufferState:
    """One storage: who wrote it last, who read it since, where its memory goes when freed."""

    home: str  # the stream whose next allocation may reuse the memory once it is freed
    nbytes: int
    write: Access | None = None
    reads: dict[str, Access] = field(default_factory=dict)


class FakeEvent:
    """``torch.cuda.Event``: remembers the recording stream's clock."""

    def __init__(self, order: StreamOrder) -> None:
        self.order = order
        self.clock: Clock | None = None  # None: never recorded

    def record(self, stream: FakeStream | None = None) -> None:
        self.order.record(self, stream or self.order.current)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.order.current).wait_event(self)

    def query(self) -> bool:
        return False  # the device lags: nothing is known to be done without a wait

    def synchronize(self) -> None:
        self.order.host_learns(self.clock or {})

    def elapsed_time(self, end: FakeEvent) -> float:
        return 0.0


class FakeStream:
    """``torch.cuda.Stream``: a name; its clock lives in the ``StreamOrder``."""

    def __init__(self, order: StreamOrder, name: str) -> None:
        self.order, self.name = order, name

    def wait_event(self, event: FakeEvent) -> None:
        self.order.wait(self, event)

    def wait_stream(self, other: FakeStream) -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.order)
        event.record(self)
        return event

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.order.host_learns(self.order.clocks[self.name])


class StreamOrder:
    """The streams' clocks, every storage's accesses, and the rule breaches found."""

    def __init__(self) -> None:
        self.clocks: dict[str, Clock] = {}
        self.host: Clock = {}  # what the host has seen finish
        self.compute = self.new_stream("compute")
        self.current = self.compute
        self.buffers: dict[int, BufferState] = {}
        self.violations: list[str] = []
        self.counts: Counter[str] = Counter()
        self.active = True
        self.in_collective = False  # its own ops (gloo's copies) are not the engine's

    def new_stream(self, name: str | None = None) -> FakeStream:
        name = name or f"comm{len(self.clocks)}"
        self.clocks[name] = {}
        return FakeStream(self, name)

    @contextlib.contextmanager
    def on(self, stream: FakeStream | None):
        """``torch.cuda.stream(stream)``."""
        previous = self.current
        self.current = stream or previous
        try:
            yield
        finally:
            self.current = previous

    def _enqueue(self, stream: str) -> Clock:
        clock = self.clocks[stream]
        _merge(clock, self.host)  # queued after what the host has seen finish
        return clock

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        event.clock = dict(self._enqueue(stream.name))
        self.counts[f"record on {stream.name}"] += 1

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.counts[f"wait on {stream.name}"] += 1
        if event.clock is None:
            self.violations.append(f"{stream.name} waits on an event that was never recorded")
            return
        _merge(self._enqueue(stream.name), event.clock)

    def host_learns(self, clock: Clock) -> None:
        _merge(self.host, clock)

    def synchronize(self) -> None:
        for clock in self.clocks.values():
            self.host_learns(clock)

    # ------------------------------------------------------------------ accesses
    def op(self, what: str, reads, writes, outputs=()) -> None:
        """One op on the current stream: it reads ``reads``, writes ``writes`` and
        allocates whichever of ``outputs`` are new storages."""
        stream = self.current
        clock = self._enqueue(stream.name)
        clock[stream.name] = clock.get(stream.name, 0) + 1
        now = Access(stream.name, clock[stream.name], what)
        for tensor in reads:  # storages first seen here were made before: on the default stream
            state = self._state(tensor, "compute")
            if state is not None:
                self._read(state, now)
        for tensor in writes:
            state = self._state(tensor, "compute")
            if state is not None:
                self._write(state, now)
        for tensor in outputs:
            state = self._state(tensor, stream.name)
            if state is not None and state.write is None and not state.reads:
                state.write = now  # a new allocation on this stream

    def _state(self, tensor: torch.Tensor, home: str) -> BufferState | None:
        if tensor.device.type != "cpu":
            return None  # meta tensors: no memory
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        key = id(storage)  # the storage's Python object lives as long as its memory
        state = self.buffers.get(key)
        if state is None:
            state = self.buffers[key] = BufferState(home, storage.nbytes())
            weakref.finalize(storage, self._freed, key).atexit = False
        return state

    def _sees(self, stream: str, earlier: Access) -> bool:
        return self.clocks[stream].get(earlier.stream, 0) >= earlier.tick

    def _breach(self, kind: str, state: BufferState, now: Access, earlier: Access) -> None:
        self.violations.append(
            f"{kind} of a {state.nbytes}-byte buffer: {now.what} on {now.stream} "
            f"(op {now.tick}) is not ordered after {earlier.what} on {earlier.stream} "
            f"(op {earlier.tick})"
        )

    def _read(self, state: BufferState, now: Access) -> None:
        self.counts["reads"] += 1
        last = state.write
        if last is not None and last.stream != now.stream:
            self.counts["cross-stream reads"] += 1
            if not self._sees(now.stream, last):
                self._breach("read", state, now, last)
        state.reads[now.stream] = now

    def _write(self, state: BufferState, now: Access, kind: str = "write") -> None:
        self.counts[f"{kind}s"] += 1
        earlier = [state.write, *state.reads.values()]
        others = [a for a in earlier if a is not None and a.stream != now.stream]
        if others:
            self.counts[f"cross-stream {kind}s"] += 1
        for access in others:
            if not self._sees(now.stream, access):
                self._breach(kind, state, now, access)
        state.write, state.reads = now, {}

    def _freed(self, key: int) -> None:
        state = self.buffers.pop(key, None)
        if state is None or not self.active:
            return
        clock = self._enqueue(state.home)
        self._write(state, Access(state.home, clock.get(state.home, 0), "free"), "free")

    @contextlib.contextmanager
    def recording(self):
        """Every aten op in the block is an ``op`` on the current stream."""
        try:
            with _Recorder(self):
                yield
        finally:
            self.active = False  # frees from now on are no longer ordered by anything


class _Recorder(TorchDispatchMode):
    """Reads: an op's tensor arguments; writes: those its schema marks written (``a!``)."""

    def __init__(self, order: StreamOrder) -> None:
        super().__init__()
        self.order = order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        order = self.order
        if order.in_collective:
            return out  # a collective is one op, recorded by its wrapper (``install``)
        read, written = _reads_and_writes(func, args, kwargs)
        order.op(str(func), read, written, _tensors(out))
        if func is torch.ops.aten._local_scalar_dense.default:  # item(): the host waits
            order.host_learns(order.clocks[order.current.name])
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# Ops that touch no data of their inputs: shapes only, or (``set_``) which memory a tensor uses.
_NO_DATA = {
    "aten::empty_like",
    "aten::new_empty",
    "aten::new_empty_strided",
    "aten::zeros_like",
    "aten::set_",
}


def _reads_and_writes(func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``func`` reads and those it writes: its schema marks both; an argument a
    view aliases (``Tensor(a)``) is not read; ``_NO_DATA`` ops touch nothing."""
    read: list[torch.Tensor] = []
    written: list[torch.Tensor] = []
    if func._schema.name in _NO_DATA:
        return read, written
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        alias = argument.alias_info
        if alias is not None and alias.is_write:
            written += _tensors(value)
        elif alias is None:
            read += _tensors(value)
    return read, written
