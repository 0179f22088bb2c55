/* smartgen._native: the C header's calls for CPython, one function each, handles as integers.
 *
 * A hand-written extension rather than SWIG (docs/bindings.md says why): the GIL is released around
 * every call that can block, waits run in slices so Ctrl-C interrupts them, engine memory arrives
 * through the buffer protocol, and the hot non-blocking calls stay one C call from Python.
 * The Pythonic layer (smartgen/__init__.py) owns lifetimes, use-after-close checks and the owners
 * of registered memory; nothing here frees a handle twice because nothing here remembers one.
 * Errors raise the exception class the Python layer installs (set_error_class), built as
 * cls(status, message).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <smartgen/smartgen.h>

#include <stdint.h>
#include <string.h>

static PyObject *error_class;  /* smartgen.Error, installed at import */

static PyObject *raise_status(sg_status_t st, const char *message) {
    if (!message || !*message) message = sg_last_error_message();
    if (!message || !*message) message = sg_status_str(st);
    PyObject *cls = error_class ? error_class : PyExc_RuntimeError;
    PyObject *exc = PyObject_CallFunction(cls, "is", (int)st, message);
    if (exc) {
        PyErr_SetObject(cls, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *raise_err(sg_status_t st, const sg_error_info_t *err) {
    return raise_status(st, err && err->message[0] ? err->message : NULL);
}

static void *as_ptr(PyObject *o) {
    if (o == Py_None) return NULL;
    return PyLong_AsVoidPtr(o);
}

static PyObject *from_ptr(void *p) { return PyLong_FromVoidPtr(p); }

/* Waits run in slices of at most this long with the GIL released, then look at signals. */
#define SLICE_NS 100000000ull

typedef sg_status_t (*wait_fn)(void *h, uint32_t a, uint32_t b, uint64_t timeout_ns);

/* timeout_ns < 0: no limit. Returns the final status, or -1 with a Python error set (a signal). */
static int sliced_wait(wait_fn fn, void *h, uint32_t a, uint32_t b, long long timeout_ns, sg_status_t *out) {
    uint64_t left = timeout_ns < 0 ? UINT64_MAX : (uint64_t)timeout_ns;
    for (;;) {
        const uint64_t slice = left < SLICE_NS ? left : SLICE_NS;
        sg_status_t st;
        Py_BEGIN_ALLOW_THREADS
        st = fn(h, a, b, slice);
        Py_END_ALLOW_THREADS
        if (st == SG_OK && left > slice) {
            /* The condition may have held just as the slice ran out, and a wait whose timeout passes
             * does not wait for the callbacks of events emitted before (sg_event_fn): wait once more
             * with what is left, which returns as soon as they have run (the condition holds), so
             * a host may release the transfer right after and miss none, as the header promises
             * (CI: a wait returned with two of four callbacks run). */
            const uint64_t rest = left == UINT64_MAX ? UINT64_MAX : left - slice;
            Py_BEGIN_ALLOW_THREADS
            st = fn(h, a, b, rest);
            Py_END_ALLOW_THREADS
        }
        if (st != SG_ERR_TIMEOUT || left <= slice) {
            *out = st;
            return 0;
        }
        if (left != UINT64_MAX) left -= slice;
        if (PyErr_CheckSignals() < 0) return -1;
    }
}

static sg_status_t w_transfer(void *h, uint32_t a, uint32_t b, uint64_t t) {
    (void)a, (void)b;
    return sg_transfer_wait((sg_transfer_t)h, t);
}
static sg_status_t w_layer_state(void *h, uint32_t a, uint32_t b, uint64_t t) {
    return sg_transfer_wait_layer_state((sg_transfer_t)h, a, b, t);
}
static sg_status_t w_quiesced(void *h, uint32_t a, uint32_t b, uint64_t t) {
    (void)a, (void)b;
    return sg_transfer_wait_quiesced((sg_transfer_t)h, t);
}
static sg_status_t w_ready(void *h, uint32_t a, uint32_t b, uint64_t t) {
    (void)a, (void)b;
    return sg_session_wait_ready((sg_session_t)h, t);
}

/* One handle in, a status out: the destroy, deregister, cancel and release calls. gil_free: the
 * call may wait on the progress thread, which may be waiting for the GIL to deliver an event. */
typedef sg_status_t (*handle_fn)(void *h);

static PyObject *call_handle(PyObject *h, handle_fn fn, int gil_free) {
    void *p = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    if (gil_free) {
        Py_BEGIN_ALLOW_THREADS
        st = fn(p);
        Py_END_ALLOW_THREADS
    } else {
        st = fn(p);
    }
    if (st != SG_OK) return raise_status(st, NULL);
    Py_RETURN_NONE;
}

/* (handle, timeout_ns) in, the wait's final status out as an int (SG_ERR_TIMEOUT included). */
static PyObject *wait_call(PyObject *args, wait_fn fn) {
    PyObject *h;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OL", &h, &timeout_ns)) return NULL;
    void *p = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    if (sliced_wait(fn, p, 0, 0, timeout_ns, &st) < 0) return NULL;
    return PyLong_FromLong(st);
}

/* (status, message) of a session or a transfer. */
typedef sg_status_t (*status_fn)(void *h, sg_status_t *status, char *msg, size_t cap);

static PyObject *status_call(PyObject *h, status_fn fn) {
    void *p = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_status_t status = SG_OK;
    char msg[SG_ERROR_MESSAGE_MAX];
    msg[0] = 0;
    const sg_status_t st = fn(p, &status, msg, sizeof msg);
    if (st != SG_OK) return raise_status(st, NULL);
    return Py_BuildValue("(is)", (int)status, msg);
}

/* ---- events: the progress thread calls in; the callback runs under the GIL ---- */

typedef struct {
    PyObject *callback;  /* strong reference, dropped by event_bridge_free after the context is gone */
} EventBridge;

static void event_trampoline(void *user, const sg_event_t *e) {
    EventBridge *b = (EventBridge *)user;
    if (!b || !b->callback || _Py_IsFinalizing()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *blocks;
    if (e->blocks) {
        blocks = PyTuple_New((Py_ssize_t)e->num_blocks);
        for (size_t i = 0; blocks && i < e->num_blocks; ++i)
            PyTuple_SET_ITEM(blocks, (Py_ssize_t)i, PyLong_FromUnsignedLong(e->blocks[i]));
    } else {
        blocks = Py_NewRef(Py_None);
    }
    PyObject *r = blocks ? PyObject_CallFunction(b->callback, "IIiNsO", (unsigned)e->kind, (unsigned)e->layer,
                                                 (int)e->status, from_ptr(e->transfer),
                                                 e->request_id ? e->request_id : "", blocks)
                         : NULL;
    Py_XDECREF(blocks);
    /* The Python layer catches what a user's callback raises; anything left is reported, never
     * propagated into the library's thread. */
    if (!r) PyErr_WriteUnraisable(b->callback);
    Py_XDECREF(r);
    PyGILState_Release(g);
}

static PyObject *py_set_error_class(PyObject *self, PyObject *cls) {
    (void)self;
    Py_XSETREF(error_class, Py_NewRef(cls));
    Py_RETURN_NONE;
}

static PyObject *py_version(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return Py_BuildValue("(sI)", sg_version_string(), (unsigned)sg_version_number());
}

/* The sentence of this thread's last failing call (sg_last_error_message): a wait the library
 * refused says why in it, where the transfer's own status says nothing. */
static PyObject *py_last_error(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(sg_last_error_message());
}

static PyObject *py_status_str(PyObject *self, PyObject *arg) {
    (void)self;
    long st = PyLong_AsLong(arg);
    if (st == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(sg_status_str((sg_status_t)st));
}

/* ---- context ---- */

static PyObject *py_context_create(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"provider", "local_addr", "lanes", "peer_timeout_ms", "auth_key", "allow_unauthenticated",
                            "manual_progress", "max_ops_in_flight", "events", NULL};
    const char *provider = NULL, *local_addr = NULL;
    unsigned lanes = 0, peer_timeout_ms = 0, manual = 0, max_ops = 0;
    int allow_unauth = 0;
    Py_buffer key = {0};
    PyObject *events = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zzIIz*pIIO", names, &provider, &local_addr, &lanes,
                                     &peer_timeout_ms, &key, &allow_unauth, &manual, &max_ops, &events))
        return NULL;
    sg_context_options_t o;
    sg_context_options_init(&o);
    o.provider = provider;
    o.local_addr = local_addr;
    o.lanes = lanes;
    o.peer_timeout_ms = peer_timeout_ms;
    o.auth_key = key.buf;
    o.auth_key_len = key.buf ? (size_t)key.len : 0;
    o.allow_unauthenticated = (uint32_t)allow_unauth;
    o.manual_progress = manual;
    o.max_ops_in_flight = max_ops;
    EventBridge *bridge = NULL;
    if (events != Py_None) {
        bridge = PyMem_RawCalloc(1, sizeof *bridge);
        if (!bridge) {
            PyBuffer_Release(&key);
            return PyErr_NoMemory();
        }
        bridge->callback = Py_NewRef(events);
        o.event_fn = event_trampoline;
        o.event_user = bridge;
    }
    sg_context_t ctx = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_context_create(&o, &ctx, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&key);
    if (st != SG_OK) {
        if (bridge) {
            Py_DECREF(bridge->callback);
            PyMem_RawFree(bridge);
        }
        return raise_err(st, &err);
    }
    return Py_BuildValue("(NN)", from_ptr(ctx), from_ptr(bridge));
}

static PyObject *py_context_destroy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *b;
    if (!PyArg_ParseTuple(args, "OO", &h, &b)) return NULL;
    sg_context_t ctx = as_ptr(h);
    EventBridge *bridge = as_ptr(b);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    /* The progress thread may be waiting for the GIL to deliver an event: release it. */
    Py_BEGIN_ALLOW_THREADS
    st = sg_context_destroy(ctx);
    Py_END_ALLOW_THREADS
    /* A refused destroy (from an event callback) leaves the context, and so its progress thread and
     * the bridge it calls, alive: the bridge goes only with the context. */
    if (st != SG_OK) return raise_status(st, NULL);
    if (bridge) {
        Py_CLEAR(bridge->callback);
        PyMem_RawFree(bridge);
    }
    Py_RETURN_NONE;
}

#define STAT(name)                                                  \
    do {                                                            \
        PyObject *v = PyLong_FromUnsignedLongLong(s.name);          \
        if (!v || PyDict_SetItemString(d, #name, v) < 0) {          \
            Py_XDECREF(v);                                          \
            Py_DECREF(d);                                           \
            return NULL;                                            \
        }                                                           \
        Py_DECREF(v);                                               \
    } while (0)

static PyObject *py_context_stats(PyObject *self, PyObject *h) {
    (void)self;
    sg_context_stats_t s;
    sg_context_stats_init(&s);
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    const sg_status_t st = sg_context_stats(ctx, &s);
    if (st != SG_OK) return raise_status(st, NULL);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    STAT(bytes_direct); STAT(bytes_staged); STAT(rma_ops); STAT(staging_copies); STAT(messages_sent);
    STAT(messages_received); STAT(retries); STAT(transfers_completed); STAT(transfers_failed);
    STAT(transfers_canceled); STAT(deadlines_hit); STAT(peers_lost); STAT(sessions_open); STAT(auth_failures);
    STAT(stalls); STAT(registrations); STAT(lanes); STAT(lane_failovers); STAT(lanes_lost);
    STAT(blocks_verified); STAT(verify_mismatches);
    return d;
}

static PyObject *py_context_metadata(PyObject *self, PyObject *h) {
    (void)self;
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    size_t len = 0;
    sg_status_t st = sg_context_get_metadata(ctx, NULL, 0, &len);
    if (st != SG_OK && st != SG_ERR_BUFFER_TOO_SMALL) return raise_status(st, NULL);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (!out) return NULL;
    st = sg_context_get_metadata(ctx, PyBytes_AS_STRING(out), len, &len);
    if (st != SG_OK) {
        Py_DECREF(out);
        return raise_status(st, NULL);
    }
    return out;
}

/* ---- listener and sessions ---- */

static PyObject *py_listener_create(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    const char *addr;
    unsigned port;
    if (!PyArg_ParseTuple(args, "OsI", &h, &addr, &port)) return NULL;
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    if (port > 65535) return PyErr_Format(PyExc_ValueError, "port %u is not a TCP port", port);
    sg_listener_t lis = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_listener_create(ctx, addr, (uint16_t)port, &lis, &err);
    Py_END_ALLOW_THREADS
    if (st != SG_OK) return raise_err(st, &err);
    uint16_t bound = 0;
    sg_listener_port(lis, &bound);
    return Py_BuildValue("(NI)", from_ptr(lis), (unsigned)bound);
}

static PyObject *py_listener_destroy(PyObject *self, PyObject *h) {
    (void)self;
    return call_handle(h, (handle_fn)sg_listener_destroy, 1);
}

static PyObject *py_session_accept(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    long long timeout_ns;
    const char *provider = NULL;
    if (!PyArg_ParseTuple(args, "OL|z", &h, &timeout_ns, &provider)) return NULL;
    sg_listener_t lis = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_session_options_t o;
    sg_session_options_init(&o);
    o.provider = provider;
    uint64_t left = timeout_ns < 0 ? UINT64_MAX : (uint64_t)timeout_ns;
    for (;;) {
        const uint64_t slice = left < SLICE_NS ? left : SLICE_NS;
        sg_session_t s = NULL;
        sg_error_info_t err;
        sg_error_info_init(&err);
        sg_status_t st;
        Py_BEGIN_ALLOW_THREADS
        st = sg_session_accept(lis, &o, slice, &s, &err);
        Py_END_ALLOW_THREADS
        if (st == SG_OK) return from_ptr(s);
        if (st != SG_ERR_TIMEOUT || left <= slice) return raise_err(st, &err);
        if (left != UINT64_MAX) left -= slice;
        if (PyErr_CheckSignals() < 0) return NULL;
    }
}

static PyObject *py_session_connect(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    const char *addr, *provider = NULL;
    unsigned port;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OsIL|z", &h, &addr, &port, &timeout_ns, &provider)) return NULL;
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    if (port > 65535) return PyErr_Format(PyExc_ValueError, "port %u is not a TCP port", port);
    sg_session_options_t o;
    sg_session_options_init(&o);
    o.provider = provider;
    sg_session_t s = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_session_connect(ctx, addr, (uint16_t)port, &o, timeout_ns < 0 ? UINT64_MAX : (uint64_t)timeout_ns, &s, &err);
    Py_END_ALLOW_THREADS
    if (st != SG_OK) return raise_err(st, &err);
    return from_ptr(s);
}

static PyObject *py_session_from_metadata(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    Py_buffer blob;
    const char *provider = NULL;
    if (!PyArg_ParseTuple(args, "Oy*|z", &h, &blob, &provider)) return NULL;
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    sg_session_options_t o;
    sg_session_options_init(&o);
    o.provider = provider;
    sg_session_t s = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_session_from_metadata(ctx, blob.buf, (size_t)blob.len, &o, &s, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&blob);
    if (st != SG_OK) return raise_err(st, &err);
    return from_ptr(s);
}

static PyObject *status_result(sg_status_t st) {
    if (st != SG_OK) return raise_status(st, NULL);
    Py_RETURN_NONE;
}

static PyObject *py_session_wait_ready(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *r = wait_call(args, w_ready);
    if (!r) return NULL;
    const long st = PyLong_AsLong(r);
    Py_DECREF(r);
    return status_result((sg_status_t)st);
}

static PyObject *py_session_export_kv(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *k;
    if (!PyArg_ParseTuple(args, "OO", &h, &k)) return NULL;
    sg_session_t s = as_ptr(h);
    sg_kv_handle_t kv = as_ptr(k);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_session_export_kv(s, kv);
    Py_END_ALLOW_THREADS
    return status_result(st);
}

static PyObject *py_session_notify(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "Oy*", &h, &data)) return NULL;
    sg_session_t s = as_ptr(h);
    sg_status_t st = SG_ERR_INVALID_HANDLE;
    if (!PyErr_Occurred()) st = sg_session_notify(s, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    if (PyErr_Occurred()) return NULL;
    return status_result(st);
}

static PyObject *py_session_next_notification(PyObject *self, PyObject *h) {
    (void)self;
    sg_session_t s = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    char buf[SG_NOTIFY_MAX];
    size_t len = 0;
    const sg_status_t st = sg_session_next_notification(s, buf, sizeof buf, &len);
    if (st == SG_ERR_AGAIN) Py_RETURN_NONE;
    if (st != SG_OK) return raise_status(st, NULL);
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)len);
}

static PyObject *py_session_error(PyObject *self, PyObject *h) {
    (void)self;
    return status_call(h, (status_fn)sg_session_error);
}

static PyObject *py_session_close(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OL", &h, &timeout_ns)) return NULL;
    sg_session_t s = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_session_close(s, timeout_ns < 0 ? UINT64_MAX : (uint64_t)timeout_ns);
    Py_END_ALLOW_THREADS
    return status_result(st);
}

static PyObject *py_session_destroy(PyObject *self, PyObject *h) {
    (void)self;
    return call_handle(h, (handle_fn)sg_session_destroy, 1);
}

/* ---- pools ---- */

static int fill_bases(PyObject *seq, Py_ssize_t n, void **out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %zd addresses for %zd layers", what, PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
        out[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* kv_register(ctx, shape tuple (layers, heads, head_dim, tokens_per_block, num_blocks, dtype, packing,
 * block_order, mem_kind, device, block_stride), k_bases, v_bases or None) -> handle */
static PyObject *py_kv_register(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *kb, *vb;
    unsigned layers, heads, head_dim, tpb, dtype, packing, order, mem;
    unsigned long long blocks, stride;
    int device;
    if (!PyArg_ParseTuple(args, "O(IIIIKIIIIiK)OO", &h, &layers, &heads, &head_dim, &tpb, &blocks, &dtype, &packing,
                          &order, &mem, &device, &stride, &kb, &vb))
        return NULL;
    sg_context_t ctx = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    if (layers == 0 || layers > (1u << 20)) return PyErr_Format(PyExc_ValueError, "num_layers %u", layers);
    void **k = PyMem_Calloc(layers, sizeof *k), **v = PyMem_Calloc(layers, sizeof *v);
    PyObject *result = NULL;
    if (!k || !v) {
        PyErr_NoMemory();
        goto done;
    }
    if (fill_bases(kb, layers, k, "k_bases") < 0) goto done;
    if (vb != Py_None && fill_bases(vb, layers, v, "v_bases") < 0) goto done;
    sg_kv_layout_t l;
    sg_kv_layout_init(&l);
    l.num_layers = layers;
    l.num_kv_heads = heads;
    l.head_dim = head_dim;
    l.tokens_per_block = tpb;
    l.num_blocks = blocks;
    l.dtype = dtype;
    l.packing = packing;
    l.block_order = order;
    l.mem_kind = mem;
    l.device = device;
    l.layer_k_base = k;
    l.layer_v_base = vb == Py_None ? NULL : v;
    l.layer_base_count = layers;
    l.block_stride_bytes = stride;
    sg_kv_handle_t kv = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = sg_kv_register(ctx, &l, &kv, &err);
    Py_END_ALLOW_THREADS
    if (st != SG_OK)
        raise_err(st, &err);
    else
        result = from_ptr(kv);
done:
    PyMem_Free(k);
    PyMem_Free(v);
    return result;
}

static PyObject *py_kv_deregister(PyObject *self, PyObject *h) {
    (void)self;
    return call_handle(h, (handle_fn)sg_kv_deregister, 1);
}

static PyObject *py_dtype_size(PyObject *self, PyObject *arg) {
    (void)self;
    long d = PyLong_AsLong(arg);
    if (d == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromSize_t(sg_dtype_size((sg_dtype_t)d));
}

/* ---- profiles ---- */

static PyObject *py_profile_parse(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer json;
    if (PyObject_GetBuffer(arg, &json, PyBUF_SIMPLE) < 0) return NULL;
    sg_profile_t p = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    const sg_status_t st = sg_profile_parse(json.buf, (size_t)json.len, &p, &err);
    PyBuffer_Release(&json);
    if (st != SG_OK) return raise_err(st, &err);
    return from_ptr(p);
}

static PyObject *py_profile_load(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *bytes;
    if (!PyUnicode_FSConverter(arg, &bytes)) return NULL;
    sg_profile_t p = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    const char *path = PyBytes_AS_STRING(bytes);
    Py_BEGIN_ALLOW_THREADS
    st = sg_profile_load(path, &p, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(bytes);
    if (st != SG_OK) return raise_err(st, &err);
    return from_ptr(p);
}

static PyObject *py_profile_destroy(PyObject *self, PyObject *h) {
    (void)self;
    return call_handle(h, (handle_fn)sg_profile_destroy, 0);
}

/* ---- transfers ---- */

/* A block table: any contiguous buffer of uint32 (array('I'), a NumPy uint32 array). */
static int get_table(PyObject *o, Py_buffer *view) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    if (view->itemsize != 4 || strcmp(f, "I") != 0) {
        PyErr_Format(PyExc_TypeError, "a block table is a contiguous buffer of uint32 (format 'I'), not '%s' of %zd-byte items",
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *start_transfer(PyObject *args, int post) {
    PyObject *h, *k, *table, *profile, *order;
    const char *rid;
    unsigned long long tokens, deadline, lease;
    unsigned paths, flags, quant;
    int priority;
    if (!PyArg_ParseTuple(args, "OsOOK(IIiKKIOO)", &h, &rid, &k, &table, &tokens, &paths, &flags, &priority, &deadline,
                          &lease, &quant, &profile, &order))
        return NULL;
    sg_session_t s = as_ptr(h);
    sg_kv_handle_t kv = as_ptr(k);
    sg_profile_t prof = as_ptr(profile);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view, order_view = {0};
    if (get_table(table, &view) < 0) return NULL;
    if (order != Py_None && get_table(order, &order_view) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    sg_transfer_options_t o;
    sg_transfer_options_init(&o);
    o.paths = paths;
    o.flags = flags;
    o.priority = priority;
    o.deadline_ns = deadline;
    o.lease_ns = lease;
    o.wire_quant = quant;
    o.profile = prof;
    if (order != Py_None) {
        o.layer_order = order_view.buf;
        o.layer_order_count = (size_t)(order_view.len / 4);
    }
    sg_transfer_t x = NULL;
    sg_error_info_t err;
    sg_error_info_init(&err);
    sg_status_t st;
    const uint32_t *ids = view.buf;
    const size_t n = (size_t)(view.len / 4);
    Py_BEGIN_ALLOW_THREADS
    st = post ? sg_transfer_post(s, rid, kv, ids, n, tokens, &o, &x, &err)
              : sg_transfer_expect(s, rid, kv, ids, n, tokens, &o, &x, &err);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (order != Py_None) PyBuffer_Release(&order_view);
    if (st != SG_OK) return raise_err(st, &err);
    return from_ptr(x);
}

static PyObject *py_transfer_post(PyObject *self, PyObject *args) {
    (void)self;
    return start_transfer(args, 1);
}
static PyObject *py_transfer_expect(PyObject *self, PyObject *args) {
    (void)self;
    return start_transfer(args, 0);
}

/* The hot non-blocking calls take positional arguments through METH_FASTCALL. */
static int fast_handle_layer(PyObject *const *args, Py_ssize_t n, void **h, uint32_t *layer) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "expected (handle, layer)");
        return -1;
    }
    *h = PyLong_AsVoidPtr(args[0]);
    const unsigned long l = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred()) return -1;
    if (l > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "layer out of range");
        return -1;
    }
    *layer = (uint32_t)l;
    return 0;
}

static PyObject *py_layer_state(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    void *h;
    uint32_t layer, state = 0;
    if (fast_handle_layer(args, n, &h, &layer) < 0) return NULL;
    const sg_status_t st = sg_transfer_layer_state((sg_transfer_t)h, layer, &state);
    if (st != SG_OK) return raise_status(st, NULL);
    return PyLong_FromUnsignedLong(state);
}

static PyObject *py_layer_written(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    void *h;
    uint32_t layer;
    if (fast_handle_layer(args, n, &h, &layer) < 0) return NULL;
    const sg_status_t st = sg_transfer_layer_written((sg_transfer_t)h, layer, NULL);
    if (st != SG_OK) return raise_status(st, NULL);
    Py_RETURN_NONE;
}

static PyObject *py_transfer_test(PyObject *self, PyObject *h) {
    (void)self;
    sg_transfer_t x = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromLong(sg_transfer_test(x));
}

static PyObject *py_transfer_status(PyObject *self, PyObject *h) {
    (void)self;
    return status_call(h, (status_fn)sg_transfer_status);
}

static PyObject *py_transfer_wait(PyObject *self, PyObject *args) {
    (void)self;
    return wait_call(args, w_transfer);
}

static PyObject *py_transfer_wait_layer_state(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h;
    unsigned layer, bits;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OIIL", &h, &layer, &bits, &timeout_ns)) return NULL;
    void *x = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_status_t st;
    if (sliced_wait(w_layer_state, x, layer, bits, timeout_ns, &st) < 0) return NULL;
    return PyLong_FromLong(st);
}

static PyObject *py_transfer_wait_quiesced(PyObject *self, PyObject *args) {
    (void)self;
    return wait_call(args, w_quiesced);
}

static PyObject *py_transfer_fetch(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *table;
    unsigned layer;
    if (!PyArg_ParseTuple(args, "OIO", &h, &layer, &table)) return NULL;
    sg_transfer_t x = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (get_table(table, &view) < 0) return NULL;
    const sg_status_t st = sg_transfer_fetch(x, layer, view.buf, (size_t)(view.len / 4));
    PyBuffer_Release(&view);
    return status_result(st);
}

static PyObject *py_transfer_wait_blocks(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *h, *table;
    unsigned layer;
    long long timeout_ns;
    if (!PyArg_ParseTuple(args, "OIOL", &h, &layer, &table, &timeout_ns)) return NULL;
    sg_transfer_t x = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (get_table(table, &view) < 0) return NULL;
    uint64_t left = timeout_ns < 0 ? UINT64_MAX : (uint64_t)timeout_ns;
    sg_status_t st;
    for (;;) {
        const uint64_t slice = left < SLICE_NS ? left : SLICE_NS;
        Py_BEGIN_ALLOW_THREADS
        st = sg_transfer_wait_blocks(x, layer, view.buf, (size_t)(view.len / 4), slice);
        Py_END_ALLOW_THREADS
        if (st != SG_ERR_TIMEOUT || left <= slice) break;
        if (left != UINT64_MAX) left -= slice;
        if (PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(st);
}

static PyObject *py_transfer_residency(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    void *h;
    uint32_t layer;
    if (fast_handle_layer(args, n, &h, &layer) < 0) return NULL;
    size_t bits = 0;
    sg_status_t st = sg_transfer_residency((sg_transfer_t)h, layer, NULL, 0, &bits);
    if (st != SG_OK && st != SG_ERR_BUFFER_TOO_SMALL) return raise_status(st, NULL);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((bits + 7) / 8));
    if (!out) return NULL;
    st = sg_transfer_residency((sg_transfer_t)h, layer, (uint8_t *)PyBytes_AS_STRING(out), (bits + 7) / 8, &bits);
    if (st != SG_OK) {
        Py_DECREF(out);
        return raise_status(st, NULL);
    }
    return Py_BuildValue("(Nn)", out, (Py_ssize_t)bits);
}

static PyObject *py_transfer_stats(PyObject *self, PyObject *h) {
    (void)self;
    sg_transfer_t x = as_ptr(h);
    if (PyErr_Occurred()) return NULL;
    sg_transfer_stats_t s;
    sg_transfer_stats_init(&s);
    const sg_status_t st = sg_transfer_stats(x, &s);
    if (st != SG_OK) return raise_status(st, NULL);
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    STAT(bytes); STAT(rma_ops); STAT(segments); STAT(staged_bytes); STAT(staging_copies); STAT(layers_ready);
    STAT(start_ns); STAT(end_ns); STAT(bytes_full); STAT(bytes_proactive); STAT(bytes_on_demand);
    STAT(bytes_speculative); STAT(digest_bytes); STAT(fetch_requests); STAT(fetch_blocks); STAT(quantized_bytes);
    STAT(quantized_wire_bytes);
    return d;
}

static PyObject *py_transfer_cancel(PyObject *self, PyObject *h) {
    (void)self;
    return call_handle(h, (handle_fn)sg_transfer_cancel, 0);
}

static PyObject *py_transfer_release(PyObject *self, PyObject *h) {
    (void)self;
    /* Release waits for quiescence and may deliver this transfer's last events. */
    return call_handle(h, (handle_fn)sg_transfer_release, 1);
}

static PyMethodDef methods[] = {
    {"set_error_class", py_set_error_class, METH_O, NULL},
    {"version", py_version, METH_NOARGS, NULL},
    {"status_str", py_status_str, METH_O, NULL},
    {"last_error", py_last_error, METH_NOARGS, NULL},
    {"context_create", (PyCFunction)(void (*)(void))py_context_create, METH_VARARGS | METH_KEYWORDS, NULL},
    {"context_destroy", py_context_destroy, METH_VARARGS, NULL},
    {"context_stats", py_context_stats, METH_O, NULL},
    {"context_metadata", py_context_metadata, METH_O, NULL},
    {"listener_create", py_listener_create, METH_VARARGS, NULL},
    {"listener_destroy", py_listener_destroy, METH_O, NULL},
    {"session_accept", py_session_accept, METH_VARARGS, NULL},
    {"session_connect", py_session_connect, METH_VARARGS, NULL},
    {"session_from_metadata", py_session_from_metadata, METH_VARARGS, NULL},
    {"session_wait_ready", py_session_wait_ready, METH_VARARGS, NULL},
    {"session_export_kv", py_session_export_kv, METH_VARARGS, NULL},
    {"session_notify", py_session_notify, METH_VARARGS, NULL},
    {"session_next_notification", py_session_next_notification, METH_O, NULL},
    {"session_error", py_session_error, METH_O, NULL},
    {"session_close", py_session_close, METH_VARARGS, NULL},
    {"session_destroy", py_session_destroy, METH_O, NULL},
    {"kv_register", py_kv_register, METH_VARARGS, NULL},
    {"kv_deregister", py_kv_deregister, METH_O, NULL},
    {"dtype_size", py_dtype_size, METH_O, NULL},
    {"profile_parse", py_profile_parse, METH_O, NULL},
    {"profile_load", py_profile_load, METH_O, NULL},
    {"profile_destroy", py_profile_destroy, METH_O, NULL},
    {"transfer_post", py_transfer_post, METH_VARARGS, NULL},
    {"transfer_expect", py_transfer_expect, METH_VARARGS, NULL},
    {"layer_state", (PyCFunction)(void (*)(void))py_layer_state, METH_FASTCALL, NULL},
    {"layer_written", (PyCFunction)(void (*)(void))py_layer_written, METH_FASTCALL, NULL},
    {"transfer_test", py_transfer_test, METH_O, NULL},
    {"transfer_status", py_transfer_status, METH_O, NULL},
    {"transfer_wait", py_transfer_wait, METH_VARARGS, NULL},
    {"transfer_wait_layer_state", py_transfer_wait_layer_state, METH_VARARGS, NULL},
    {"transfer_wait_quiesced", py_transfer_wait_quiesced, METH_VARARGS, NULL},
    {"transfer_fetch", py_transfer_fetch, METH_VARARGS, NULL},
    {"transfer_wait_blocks", py_transfer_wait_blocks, METH_VARARGS, NULL},
    {"transfer_residency", (PyCFunction)(void (*)(void))py_transfer_residency, METH_FASTCALL, NULL},
    {"transfer_stats", py_transfer_stats, METH_O, NULL},
    {"transfer_cancel", py_transfer_cancel, METH_O, NULL},
    {"transfer_release", py_transfer_release, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "smartgen._native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
#define CONST(name) PyModule_AddIntConstant(m, #name, name)
    CONST(SG_OK);
    CONST(SG_IN_PROGRESS);
    CONST(SG_ERR_INVALID_ARGUMENT);
    CONST(SG_ERR_INVALID_HANDLE);
    CONST(SG_ERR_INVALID_LAYOUT);
    CONST(SG_ERR_LAYOUT_MISMATCH);
    CONST(SG_ERR_OUT_OF_RANGE);
    CONST(SG_ERR_BUFFER_TOO_SMALL);
    CONST(SG_ERR_INVALID_STATE);
    CONST(SG_ERR_DUPLICATE);
    CONST(SG_ERR_VERSION_MISMATCH);
    CONST(SG_ERR_NOT_FOUND);
    CONST(SG_ERR_NO_MEMORY);
    CONST(SG_ERR_AGAIN);
    CONST(SG_ERR_TIMEOUT);
    CONST(SG_ERR_CANCELED);
    CONST(SG_ERR_TRANSPORT);
    CONST(SG_ERR_PEER_LOST);
    CONST(SG_ERR_PROTOCOL);
    CONST(SG_ERR_DEADLINE);
    CONST(SG_ERR_CONNECT);
    CONST(SG_ERR_REMOTE);
    CONST(SG_ERR_AUTH_FAILED);
    CONST(SG_ERR_AUTH_REQUIRED);
    CONST(SG_ERR_LEASE_EXPIRED);
    CONST(SG_ERR_UNSUPPORTED);
    CONST(SG_ERR_NO_PROVIDER);
    CONST(SG_ERR_INTERNAL);
    CONST(SG_PATH_FULL); CONST(SG_PATH_PROACTIVE); CONST(SG_PATH_ON_DEMAND); CONST(SG_PATH_SPECULATIVE);
    CONST(SG_TRANSFER_ALL_LAYERS_WRITTEN);
    CONST(SG_LAYER_READY); CONST(SG_LAYER_ESSENTIAL);
    CONST(SG_DTYPE_FP32); CONST(SG_DTYPE_FP16); CONST(SG_DTYPE_BF16); CONST(SG_DTYPE_FP8_E4M3);
    CONST(SG_KV_SEPARATE); CONST(SG_KV_FUSED); CONST(SG_BLOCK_TOKEN_MAJOR); CONST(SG_BLOCK_HEAD_MAJOR);
    CONST(SG_MEM_HOST); CONST(SG_MEM_CUDA);
    CONST(SG_EVENT_LAYER_READY); CONST(SG_EVENT_FINISHED); CONST(SG_EVENT_QUIESCED); CONST(SG_EVENT_ESSENTIAL_READY);
    CONST(SG_EVENT_BLOCKS_READY); CONST(SG_EVENT_LEASE_EXPIRED);
    CONST(SG_WIRE_QUANT_NONE); CONST(SG_WIRE_QUANT_INT8); CONST(SG_WIRE_QUANT_FP8_E4M3);
#undef CONST
    return m;
}
