"""SmartGen for Python: KV-cache transfer between a prefill and a decode engine.

The objects mirror the C header (include/smartgen/smartgen.h): a Context owns sessions and
pools, a Session carries transfers between two contexts, a Transfer moves one request's KV
blocks layer by layer. Every object is a context manager; closing one twice is harmless and
using one after close raises Error(SG_ERR_INVALID_HANDLE). Failures raise Error, which carries
the status code and the library's message. Waits release the GIL, take a timeout in seconds
(None: no limit) and are interrupted by Ctrl-C.

Engine-owned memory first (docs/bindings.md):

    import numpy as np, smartgen
    k = np.zeros((layers, blocks, tokens_per_block, kv_heads, head_dim), np.float16)
    v = np.zeros_like(k)
    with smartgen.Context(provider="tcp") as ctx:
        pool = ctx.register_pool(k, v)          # layout from shape and dtype; k, v kept alive
"""

from __future__ import annotations

import array
import asyncio
import atexit
import ctypes
import ctypes.util
import math
import operator
import queue as _queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


def _signal_dispositions() -> Optional[list]:
    """The process's signal dispositions (raw struct sigaction bytes for signals 1-31), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    saved = []
    for sig in range(1, 32):
        buf = ctypes.create_string_buffer(256)  # larger than any libc's struct sigaction
        saved.append((sig, buf if libc.sigaction(sig, None, buf) == 0 else None))
    return [libc, saved]


def _restore_signal_dispositions(before: Optional[list]) -> None:
    """Puts back every disposition that changed since `before`. Loading libsmartgen loads libfabric,
    whose psm provider (libinfinipath) installs handlers from its constructor, and libsmartgen's
    constructor then resets those to the default action: right for a C host, but it left this
    interpreter's SIGINT handler uninstalled, so Ctrl-C killed the process at once (no
    KeyboardInterrupt, no finally, no atexit). The Java binding does the same (signals.c)."""
    if before is None:
        return
    libc, saved = before
    for sig, buf in saved:
        if buf is None or sig in (9, 19):  # SIGKILL, SIGSTOP
            continue
        now = ctypes.create_string_buffer(256)
        if libc.sigaction(sig, None, now) == 0 and now.raw != buf.raw:
            libc.sigaction(sig, buf, None)


_before_load = _signal_dispositions()
from . import _native  # noqa: E402 - the dispositions are read before the library loads
_restore_signal_dispositions(_before_load)
del _before_load

__all__ = [
    "Error", "Context", "Listener", "Session", "Pool", "Transfer", "Profile", "Event", "version",
    "PATH_FULL", "PATH_PROACTIVE", "PATH_ON_DEMAND", "PATH_SPECULATIVE", "PATHS_SELECTIVE",
    "LAYER_READY", "LAYER_ESSENTIAL", "WIRE_QUANT_NONE", "WIRE_QUANT_INT8", "WIRE_QUANT_FP8",
]

# Status codes, as in the header: smartgen.SG_ERR_TIMEOUT and so on.
for _name in dir(_native):
    if _name in ("SG_OK", "SG_IN_PROGRESS") or _name.startswith("SG_ERR_"):
        globals()[_name] = getattr(_native, _name)
        __all__.append(_name)

PATH_FULL = _native.SG_PATH_FULL
PATH_PROACTIVE = _native.SG_PATH_PROACTIVE
PATH_ON_DEMAND = _native.SG_PATH_ON_DEMAND
PATH_SPECULATIVE = _native.SG_PATH_SPECULATIVE
PATHS_SELECTIVE = PATH_PROACTIVE | PATH_ON_DEMAND | PATH_SPECULATIVE
LAYER_READY = _native.SG_LAYER_READY
LAYER_ESSENTIAL = _native.SG_LAYER_ESSENTIAL
WIRE_QUANT_NONE = _native.SG_WIRE_QUANT_NONE
WIRE_QUANT_INT8 = _native.SG_WIRE_QUANT_INT8
WIRE_QUANT_FP8 = _native.SG_WIRE_QUANT_FP8_E4M3

EVENT_LAYER_READY = _native.SG_EVENT_LAYER_READY
EVENT_FINISHED = _native.SG_EVENT_FINISHED
EVENT_QUIESCED = _native.SG_EVENT_QUIESCED
EVENT_ESSENTIAL_READY = _native.SG_EVENT_ESSENTIAL_READY
EVENT_BLOCKS_READY = _native.SG_EVENT_BLOCKS_READY
EVENT_LEASE_EXPIRED = _native.SG_EVENT_LEASE_EXPIRED


class Error(Exception):
    """A SmartGen call failed. status: the SG_ERR_* code; message: the library's text."""

    def __init__(self, status: int, message: str = ""):
        self.status = int(status)
        self.message = message or _native.status_str(self.status)
        super().__init__(f"{_native.status_str(self.status)}: {self.message}")

    @property
    def name(self) -> str:
        return _native.status_str(self.status)


_native.set_error_class(Error)


def version() -> str:
    """The library's version string (sg_version_string)."""
    return _native.version()[0]


def _closed(what: str) -> Error:
    return Error(_native.SG_ERR_INVALID_HANDLE, f"the {what} is closed")


def _ns(timeout: Optional[float]) -> int:
    """Seconds to nanoseconds for the library; None and math.inf mean no limit."""
    if timeout is None:
        return -1
    if math.isnan(timeout):
        raise ValueError("timeout is NaN")
    if timeout < 0:
        raise ValueError(f"timeout {timeout} is negative")
    if math.isinf(timeout) or timeout * 1e9 >= 2**63:
        return -1
    return int(timeout * 1e9)


def _port(port: int) -> int:
    port = operator.index(port)
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is not a TCP port (0 to 65535)")
    return port


def _block_id(b: Any) -> int:
    try:
        i = operator.index(b)  # ints and NumPy integers; not floats, which would truncate
    except TypeError:
        raise ValueError(f"block id {b!r} is not an integer") from None
    if not 0 <= i < 2**32:
        raise ValueError(f"block id {i} is negative or past 2**32 - 1")
    return i


def _table(blocks: Any) -> Any:
    """A block table as a uint32 buffer: NumPy uint32 arrays and array('I') pass as they are."""
    try:
        view = memoryview(blocks)
        if view.format == "I" and view.c_contiguous:
            return blocks
    except TypeError:
        pass
    return array.array("I", (_block_id(b) for b in blocks))


@dataclass(frozen=True)
class Event:
    """One transfer event, as the progress thread delivered it (sg_event_t)."""

    kind: int
    layer: int
    status: int
    request_id: str
    blocks: Optional[tuple]
    transfer: Optional["Transfer"]


# ---- memory the engine owns ----

_DTYPES = {  # name -> (SG_DTYPE_*, bytes)
    "float32": (_native.SG_DTYPE_FP32, 4),
    "float16": (_native.SG_DTYPE_FP16, 2),
    "bfloat16": (_native.SG_DTYPE_BF16, 2),
    "float8_e4m3fn": (_native.SG_DTYPE_FP8_E4M3, 1),
}
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
                "fp8_e4m3": "float8_e4m3fn"}


@dataclass
class _Memory:
    address: int
    nbytes: int
    shape: tuple
    dtype: Optional[str]  # the object's dtype name (a KV dtype of _DTYPES or another), None when it has none
    cuda_device: Optional[int]
    owner: Any


def _memory_of(obj: Any) -> _Memory:
    """Address, size, shape and dtype of a torch tensor, a NumPy array or a writable buffer."""
    mod = type(obj).__module__
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        if not obj.is_contiguous():
            raise ValueError("the tensor is not contiguous: register its .contiguous() storage, or give "
                             "the layout explicitly over the memory it really uses")
        dtype = str(obj.dtype).replace("torch.", "")
        device = obj.device
        cuda = device.index if device.type == "cuda" else None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensors on {device.type} cannot be registered (host or CUDA only)")
        return _Memory(obj.data_ptr(), obj.numel() * obj.element_size(), tuple(obj.shape),
                       dtype, cuda if cuda is None else int(cuda or 0), obj)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:  # NumPy and friends
        if not obj.flags["C_CONTIGUOUS"]:
            raise ValueError("the array is not C-contiguous: pass np.ascontiguousarray(a) and keep it")
        if obj.flags["WRITEABLE"] is False:
            raise ValueError("the array is read-only: SmartGen writes into registered pools")
        name = obj.dtype.name
        return _Memory(iface["data"][0], obj.nbytes, tuple(obj.shape), name, None, obj)
    cuda_iface = getattr(obj, "__cuda_array_interface__", None)
    if cuda_iface is not None:
        raise ValueError("CUDA arrays other than torch tensors: give torch tensors, or the address explicitly")
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot register a {type(obj).__name__}: give a NumPy array, a torch tensor "
                        "or a writable buffer") from None
    if view.readonly:
        raise ValueError("the buffer is read-only: SmartGen writes into registered pools")
    if not view.c_contiguous:
        raise ValueError("the buffer is not contiguous")
    if view.nbytes == 0:
        raise ValueError("the buffer is empty")
    address = ctypes.addressof(ctypes.c_char.from_buffer(view.cast("B")))
    return _Memory(address, view.nbytes, tuple(view.shape or ()), None, None, obj)


# Event callbacks under way on this thread (Context._deliver): the library refuses to tear down from
# one, and a finalizer that runs there hands its close to the deferred-close thread.
_callbacks = threading.local()


def _in_callback() -> bool:
    return getattr(_callbacks, "depth", 0) > 0


_ASYNC_SLICE = 0.1  # seconds an asyncio wait runs in the executor before it looks for a cancel

_deferred: "Optional[_queue.SimpleQueue]" = None
_deferred_lock = threading.Lock()


def _defer(close: Callable[[], None]) -> None:
    """Runs close on a thread of the binding's own: a finalizer on the progress thread (an object
    dropped inside an event callback) cannot close there, and must not leak (the Rust binding's
    Drop does the same)."""
    global _deferred
    with _deferred_lock:
        if _deferred is None:
            q: _queue.SimpleQueue = _queue.SimpleQueue()
            threading.Thread(target=_run_deferred, args=(q,), name="smartgen-deferred-close", daemon=True).start()
            _deferred = q
    _deferred.put(close)


def _run_deferred(q: "_queue.SimpleQueue") -> None:
    while True:
        close = q.get()
        try:
            close()
        except Exception:
            pass
        del close


class _Handle:
    """A library handle and the lock that orders its close against its use.

    The rule every close follows (docs/bindings.md): the object lets go of its handle, and of what
    it owns, only once the library has accepted the call; a call the library refuses changes
    nothing on this side either."""

    _what = "object"

    def __init__(self, handle: Any):
        self._h = handle
        self._closing = False  # a close is under way on some thread
        self._lock = threading.Lock()

    def _handle(self):
        h = self._h
        if h is None or self._closing:
            raise _closed(self._what)
        return h

    def _end_handle(self, end: Callable[[Any], None]) -> Any:
        """Calls end(handle) for the one caller that claims the handle; returns the handle once
        end returned, or None when it was closed or being closed already. When end raises, the
        object keeps its handle (and the exception propagates)."""
        with self._lock:
            h = self._h
            if h is None or self._closing:
                return None
            self._closing = True
        try:
            end(h)
        except BaseException:
            with self._lock:
                self._closing = False
            raise
        with self._lock:
            self._h = None
            self._closing = False
        return h

    def _forget(self) -> None:
        """The library released the handle with its owner (a context's destroy)."""
        with self._lock:
            self._h = None

    @property
    def closed(self) -> bool:
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        if getattr(self, "_h", None) is None:
            return
        try:
            self.close()
        except Error as e:
            if e.status == _native.SG_ERR_INVALID_STATE and _in_callback():
                _defer(self.close)
        except Exception:
            pass


class Profile(_Handle):
    """A selection profile (sg_profile_parse / sg_profile_load): which blocks matter per layer."""

    _what = "profile"

    def __init__(self, json: Optional[str | bytes] = None, *, path: Optional[str] = None):
        if (json is None) == (path is None):
            raise ValueError("give the profile's JSON or its path, one of them")
        if path is not None:
            super().__init__(_native.profile_load(path))
        else:
            super().__init__(_native.profile_parse(json.encode() if isinstance(json, str) else json))

    def close(self) -> None:
        self._end_handle(_native.profile_destroy)


class Pool(_Handle):
    """A registered paged KV pool over memory the engine owns; the owners stay alive while it lives."""

    _what = "pool"

    def __init__(self, ctx: "Context", handle: Any, owners: list, layout: dict):
        super().__init__(handle)
        self.context = ctx
        self.layout = layout
        self._owners = owners

    def close(self) -> None:
        """Deregisters the pool. Refused (Error, the pool left open and its arrays kept) while a
        transfer that has not been released uses it."""
        if self._end_handle(_native.kv_deregister) is not None:
            self.context._pools.discard(self)
            self._owners = []


class Transfer(_Handle):
    """One request's KV moving between the sessions' two pools (sg_transfer_*)."""

    _what = "transfer"

    def __init__(self, session: "Session", handle: Any, request_id: str, pool: Pool):
        super().__init__(handle)
        self.session = session
        self.request_id = request_id
        self._pool = pool  # a transfer holds its pool's memory in use until released

    # Non-blocking calls: one native call each.
    def layer_state(self, layer: int) -> int:
        """SG_LAYER_* bits of one layer, now."""
        return _native.layer_state(self._handle(), layer)

    def layer_written(self, layer: int) -> None:
        """Prefill side: the layer's KV is in the pool; its blocks may go."""
        _native.layer_written(self._handle(), layer)

    def test(self) -> int:
        """SG_OK when complete, SG_IN_PROGRESS while it runs, else how it ended (a negative SG_ERR_*)."""
        return _native.transfer_test(self._handle())

    @property
    def status(self) -> tuple:
        """(status, message): SG_OK, SG_IN_PROGRESS while it runs, or how it ended."""
        return _native.transfer_status(self._handle())

    def stats(self) -> dict:
        return _native.transfer_stats(self._handle())

    def residency(self, layer: int) -> list:
        """Decode side: for each logical block of the request, whether its bytes are in place."""
        bits, n = _native.transfer_residency(self._handle(), layer)
        return [bool(bits[i // 8] >> (i % 8) & 1) for i in range(n)]

    def fetch(self, layer: int, blocks: Sequence[int]) -> None:
        """Decode side, on-demand path: asks for logical blocks of a layer now."""
        _native.transfer_fetch(self._handle(), layer, _table(blocks))

    def cancel(self) -> None:
        _native.transfer_cancel(self._handle())

    # Waits: the GIL is released; Error on failure, TimeoutError-like Error(SG_ERR_TIMEOUT) on time.
    def _check(self, st: int, what: str) -> None:
        if st == _native.SG_OK:
            return
        if st == _native.SG_ERR_TIMEOUT:
            raise Error(st, f"{what}: the timeout passed first")
        refused = _native.last_error()  # read first: the status call below may fail too
        status, message = self.status
        # The transfer's own failure, or the wait refused (say, from an event callback): its sentence.
        raise Error(st, message if status == st and message else refused)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until the transfer completes; raises Error with how it failed otherwise."""
        self._check(_native.transfer_wait(self._handle(), _ns(timeout)), "wait")

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        self.wait_layer_state(layer, LAYER_READY, timeout)

    def wait_layer_state(self, layer: int, bits: int, timeout: Optional[float] = None) -> None:
        self._check(_native.transfer_wait_layer_state(self._handle(), layer, bits, _ns(timeout)), "wait_layer_state")

    def wait_blocks(self, layer: int, blocks: Sequence[int], timeout: Optional[float] = None) -> None:
        self._check(_native.transfer_wait_blocks(self._handle(), layer, _table(blocks), _ns(timeout)), "wait_blocks")

    def wait_quiesced(self, timeout: Optional[float] = None) -> None:
        st = _native.transfer_wait_quiesced(self._handle(), _ns(timeout))
        if st == _native.SG_ERR_TIMEOUT:
            raise Error(st, "wait_quiesced: the timeout passed first")

    async def _in_executor(self, wait: Callable[[Optional[float]], None], timeout: Optional[float]) -> None:
        """Runs wait in the loop's default executor in slices of 0.1 s, so that a cancelled await
        (asyncio.wait_for, task.cancel) ends the executor's wait within a slice: a wait of its own
        would outlive the await and keep asyncio.run() from returning."""
        cancelled = threading.Event()
        limit = _ns(timeout)
        deadline = None if limit < 0 else time.monotonic() + limit / 1e9

        def sliced() -> None:
            while not cancelled.is_set():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    wait(_ASYNC_SLICE if left is None else min(_ASYNC_SLICE, left))
                    return
                except Error as e:
                    if e.status != _native.SG_ERR_TIMEOUT or (left is not None and left <= _ASYNC_SLICE):
                        raise

        try:
            await asyncio.get_running_loop().run_in_executor(None, sliced)
        finally:
            cancelled.set()

    async def wait_async(self, timeout: Optional[float] = None) -> None:
        """wait() for asyncio hosts, in the loop's default executor; cancelling the await ends it."""
        await self._in_executor(self.wait, timeout)

    async def wait_layer_async(self, layer: int, timeout: Optional[float] = None) -> None:
        await self._in_executor(lambda t: self.wait_layer(layer, t), timeout)

    def release(self) -> None:
        """Ends the transfer (canceling it if incomplete), waits until no write uses its blocks.
        Refused (Error SG_ERR_INVALID_STATE, the transfer left as it was) from an event callback."""
        h = self._end_handle(_native.transfer_release)
        if h is not None:
            self.session.context._transfers.pop(h, None)
            self._pool = None

    close = release


class Session(_Handle):
    """Two contexts' link: pools exported to it, transfers posted and expected on it."""

    _what = "session"

    def __init__(self, ctx: "Context", handle: Any):
        super().__init__(handle)
        self.context = ctx

    def export(self, pool: Pool) -> None:
        """Sends the pool's layout and keys to the peer (sg_session_export_kv)."""
        _native.session_export_kv(self._handle(), pool._handle())

    def _options(self, paths, all_layers_written, priority, deadline, lease, wire_quant, profile, layer_order):
        flags = _native.SG_TRANSFER_ALL_LAYERS_WRITTEN if all_layers_written else 0
        prof = profile._handle() if profile is not None else None
        order = _table(layer_order) if layer_order is not None else None
        return (paths, flags, priority, 0 if deadline is None else int(deadline * 1e9),
                0 if lease is None else int(lease * 1e9), wire_quant, prof, order)

    def post(self, request_id: str, pool: Pool, blocks: Sequence[int], num_tokens: int, *, paths: int = PATH_FULL,
             all_layers_written: bool = False, priority: int = 0, deadline: Optional[float] = None,
             lease: Optional[float] = None, wire_quant: int = WIRE_QUANT_NONE, profile: Optional[Profile] = None,
             layer_order: Optional[Sequence[int]] = None) -> Transfer:
        """Prefill side: sends the request's blocks of `pool` as its layers are written."""
        opts = self._options(paths, all_layers_written, priority, deadline, lease, wire_quant, profile, layer_order)
        h = _native.transfer_post(self._handle(), request_id, pool._handle(), _table(blocks), num_tokens, opts)
        return self.context._track(Transfer(self, h, request_id, pool))

    def expect(self, request_id: str, pool: Pool, blocks: Sequence[int], num_tokens: int, *, paths: int = 0,
               priority: int = 0, deadline: Optional[float] = None, wire_quant: int = WIRE_QUANT_NONE) -> Transfer:
        """Decode side: the request's KV lands in these blocks of `pool`."""
        opts = self._options(paths, False, priority, deadline, None, wire_quant, None, None)
        h = _native.transfer_expect(self._handle(), request_id, pool._handle(), _table(blocks), num_tokens, opts)
        return self.context._track(Transfer(self, h, request_id, pool))

    def notify(self, data: bytes | str) -> None:
        """A small application message to the peer (at most 4096 bytes)."""
        _native.session_notify(self._handle(), data.encode() if isinstance(data, str) else data)

    def next_notification(self) -> Optional[bytes]:
        """The oldest notification that arrived, or None."""
        return _native.session_next_notification(self._handle())

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        _native.session_wait_ready(self._handle(), _ns(timeout))

    @property
    def error(self) -> tuple:
        """(status, message): SG_OK while the session is usable."""
        return _native.session_error(self._handle())

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Graceful close (pending transfers finish, the peer is told), then destroy. Refused
        (Error SG_ERR_INVALID_STATE, the session left open) from an event callback."""
        def end(h: Any) -> None:
            if timeout:
                try:
                    _native.session_close(h, _ns(timeout))
                except Error as e:
                    if e.status == _native.SG_ERR_INVALID_STATE and _in_callback():
                        raise
                    # a lost or closing peer: destroy still frees everything
            _native.session_destroy(h)

        if self._end_handle(end) is not None:
            self.context._sessions.discard(self)

    def destroy(self) -> None:
        """Destroys at once, without the graceful close."""
        self.close(timeout=0)


class Listener(_Handle):
    """Bootstrap listener: accepts sessions from peers that connect to (address, port)."""

    _what = "listener"

    def __init__(self, ctx: "Context", addr: str, port: int):
        h, self.port = _native.listener_create(ctx._handle(), addr, _port(port))
        super().__init__(h)
        self.context = ctx
        self.address = addr

    def accept(self, timeout: Optional[float] = None, provider: Optional[str] = None) -> Session:
        return self.context._adopt(_native.session_accept(self._handle(), _ns(timeout), provider))

    def close(self) -> None:
        if self._end_handle(_native.listener_destroy) is not None:
            self.context._listeners.discard(self)


_live_contexts: "weakref.WeakSet[Context]" = weakref.WeakSet()


class Context(_Handle):
    """A SmartGen context: its fabric endpoints, progress thread, sessions and pools.

    on_event: a callable taking an Event, run on the library's progress thread under the GIL; an
    exception it raises is counted (callback_errors) and reported through sys.unraisablehook,
    never propagated into the library. events: a queue.Queue (or anything with put) that receives
    every Event instead. The library holds the callback, not the context: a context nothing else
    references is collected (and destroyed) like any object, callback or not. A tcp context is
    about 0.2 MB until its first session opens its endpoints, then about 70 MB resident a lane
    (140 MB with the default two); a shm context 4-8 MB (README, "Cost"): make one per process,
    not one per request.
    From a callback, close() of a context, session or transfer and release() raise
    Error(SG_ERR_INVALID_STATE) and leave the object as it was (the library's own rule); an object
    dropped there is closed on a thread of the binding's own.
    """

    _what = "context"

    def __init__(self, provider: Optional[str] = None, *, local_addr: Optional[str] = None, lanes: int = 0,
                 peer_timeout: Optional[float] = None, auth_key: Optional[bytes] = None,
                 allow_unauthenticated: bool = False, on_event: Optional[Callable[[Event], None]] = None,
                 events: Optional[Any] = None, max_ops_in_flight: int = 0):
        if on_event is not None and events is not None:
            raise ValueError("give on_event or events, not both")
        self._on_event = on_event
        self._event_queue = events
        self.callback_errors = 0
        self._transfers: "weakref.WeakValueDictionary[int, Transfer]" = weakref.WeakValueDictionary()
        self._sessions: set = set()
        self._listeners: set = set()
        self._pools: set = set()
        deliver = None
        if on_event is not None or events is not None:
            # A weak reference: the library's bridge must not keep the context alive.
            this = weakref.ref(self)

            def deliver(kind, layer, status, handle, request_id, blocks):
                ctx = this()
                if ctx is not None:
                    ctx._deliver(kind, layer, status, handle, request_id, blocks)
        h, self._bridge = _native.context_create(
            provider, local_addr, lanes, 0 if peer_timeout is None else int(peer_timeout * 1000), auth_key,
            allow_unauthenticated, 0, max_ops_in_flight, deliver)
        super().__init__(h)
        _live_contexts.add(self)

    def _deliver(self, kind, layer, status, handle, request_id, blocks):
        ev = Event(kind, layer, status, request_id, blocks, self._transfers.get(handle))
        _callbacks.depth = getattr(_callbacks, "depth", 0) + 1
        try:
            if self._on_event is not None:
                self._on_event(ev)
            else:
                self._event_queue.put(ev)
        except BaseException:  # noqa: B036 - a KeyboardInterrupt here belongs to no caller either
            self.callback_errors += 1
            import sys
            sys.unraisablehook(_Unraisable(sys.exc_info(), self._on_event or self._event_queue))
        finally:
            _callbacks.depth -= 1

    def _track(self, t: Transfer) -> Transfer:
        self._transfers[t._h] = t
        return t

    def _adopt(self, handle) -> Session:
        s = Session(self, handle)
        self._sessions.add(s)
        return s

    @property
    def metadata(self) -> bytes:
        """This context's metadata blob, for a peer's session_from_metadata."""
        return _native.context_metadata(self._handle())

    def stats(self) -> dict:
        return _native.context_stats(self._handle())

    def listen(self, addr: str = "127.0.0.1", port: int = 0) -> Listener:
        lis = Listener(self, addr, port)
        self._listeners.add(lis)
        return lis

    def connect(self, addr: str, port: int, timeout: Optional[float] = 10.0, provider: Optional[str] = None) -> Session:
        return self._adopt(_native.session_connect(self._handle(), addr, _port(port), _ns(timeout), provider))

    def session_from_metadata(self, blob: bytes, provider: Optional[str] = None) -> Session:
        return self._adopt(_native.session_from_metadata(self._handle(), blob, provider))

    def register_pool(self, k: Any, v: Any = None, *, tokens_per_block: Optional[int] = None,
                      num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                      dtype: Optional[str] = None, head_major: bool = False, fused: bool = False) -> Pool:
        """Registers a paged KV pool over memory the engine already has.

        k (and v for separate K/V planes): a NumPy array, a torch tensor (CPU or CUDA) or any
        writable buffer, either one object holding every layer (its first axis the layer) or a
        list with one object per layer. The layout comes from the shape where it is unambiguous:
        per layer [num_blocks, tokens_per_block, num_kv_heads, head_dim] (token-major, vLLM's
        order) or, with head_major=True, [num_blocks, num_kv_heads, tokens_per_block, head_dim];
        with fused=True (v None) each block holds K then V: [num_blocks, 2, ...]. Otherwise give
        tokens_per_block, num_kv_heads, head_dim and dtype ("float16", "bfloat16", "float32",
        "float8_e4m3fn") and num_blocks follows from the size. The objects stay referenced by the
        pool until it is closed.
        """
        if fused and v is not None:
            raise ValueError("a fused pool holds K and V in k: give v=None")
        if not fused and v is None:
            raise ValueError("separate K and V need v (or fused=True)")
        k_layers = self._per_layer(k, "k")
        v_layers = self._per_layer(v, "v") if v is not None else None
        if v_layers is not None and len(v_layers) != len(k_layers):
            raise ValueError(f"{len(k_layers)} K layers but {len(v_layers)} V layers")
        first = k_layers[0]
        dt = _DTYPE_NAMES.get(dtype, dtype) if dtype is not None else first.dtype
        if dt not in _DTYPES:
            raise ValueError(f"dtype {dt!r} is not a KV dtype SmartGen moves "
                             "(float16, bfloat16, float32, float8_e4m3fn): give dtype= for raw buffers")
        if dtype is None and v_layers is not None and v_layers[0].dtype != first.dtype:
            raise ValueError(f"K is {first.dtype} but V is {v_layers[0].dtype}: K and V must have one dtype")
        code, item = _DTYPES[dt]
        shape = first.shape[1 + fused:] if len(first.shape) == 4 + fused else None
        if shape is not None and (tokens_per_block, num_kv_heads, head_dim) == (None, None, None):
            a, b, head_dim = shape
            tokens_per_block, num_kv_heads = (b, a) if head_major else (a, b)
        if None in (tokens_per_block, num_kv_heads, head_dim):
            raise ValueError(f"cannot derive the layout from shape {first.shape}: give tokens_per_block, "
                             "num_kv_heads and head_dim")
        plane = tokens_per_block * num_kv_heads * head_dim * item
        stride = plane * (2 if fused else 1)
        for m in k_layers + (v_layers or []):
            if m.dtype is not None and dtype is None and m.dtype != dt:
                raise ValueError(f"K and V layers differ in dtype ({m.dtype} against {dt})")
            if m.nbytes != first.nbytes:
                raise ValueError("every layer's K and V memory must be the same size")
            if (m.cuda_device is None) != (first.cuda_device is None) or m.cuda_device != first.cuda_device:
                raise ValueError("every layer must live in the same kind of memory (host, or one CUDA device)")
        if first.nbytes % stride:
            raise ValueError(f"{first.nbytes} bytes per layer is not a whole number of {stride}-byte blocks")
        num_blocks = first.nbytes // stride
        mem = _native.SG_MEM_HOST if first.cuda_device is None else _native.SG_MEM_CUDA
        layout = (len(k_layers), num_kv_heads, head_dim, tokens_per_block, num_blocks, code,
                  _native.SG_KV_FUSED if fused else _native.SG_KV_SEPARATE,
                  _native.SG_BLOCK_HEAD_MAJOR if head_major else _native.SG_BLOCK_TOKEN_MAJOR,
                  mem, first.cuda_device or 0, stride)
        h = _native.kv_register(self._handle(), layout, [m.address for m in k_layers],
                                [m.address for m in v_layers] if v_layers is not None else None)
        owners = [k, v]
        info = dict(num_layers=len(k_layers), num_kv_heads=num_kv_heads, head_dim=head_dim,
                    tokens_per_block=tokens_per_block, num_blocks=num_blocks, dtype=dt, fused=fused,
                    head_major=head_major, block_stride_bytes=stride, cuda_device=first.cuda_device)
        pool = Pool(self, h, owners, info)
        self._pools.add(pool)
        return pool

    @staticmethod
    def _per_layer(obj: Any, what: str) -> list:
        if isinstance(obj, (list, tuple)):
            if not obj:
                raise ValueError(f"{what}: no layers")
            return [_memory_of(o) for o in obj]
        whole = _memory_of(obj)
        if len(whole.shape) < 2:
            raise ValueError(f"{what}: one object for every layer needs the layer as its first axis "
                             f"(shape {whole.shape}); or give a list with one object per layer")
        layers = whole.shape[0]
        per = whole.nbytes // layers
        return [_Memory(whole.address + i * per, per, whole.shape[1:], whole.dtype, whole.cuda_device, obj)
                for i in range(layers)]

    def close(self) -> None:
        """Destroys the context: its sessions, listeners and pools go with it. Refused
        (Error SG_ERR_INVALID_STATE, everything left open) from an event callback."""
        bridge = self._bridge
        if self._end_handle(lambda h: _native.context_destroy(h, bridge)) is None:
            return
        self._bridge = None
        for t in list(self._transfers.values()):
            t._forget()  # the library released them with their sessions
        for objs in (self._sessions, self._listeners, self._pools):
            for o in list(objs):
                o._forget()
            objs.clear()
        _live_contexts.discard(self)


class _Unraisable:
    def __init__(self, exc_info, obj):
        self.exc_type, self.exc_value, self.exc_traceback = exc_info
        self.err_msg = "Exception in a SmartGen event callback"
        self.object = obj


@atexit.register
def _close_live_contexts() -> None:
    # A context left open at exit would have its progress thread call into a finalizing interpreter.
    for ctx in list(_live_contexts):
        try:
            ctx.close()
        except Exception:
            pass
