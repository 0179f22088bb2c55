/* Go part of the SWIG interface (swig -go -cgo -intgosize 64 -package raw), read by smartgen.i
 * before the header. It shapes the raw layer that bindings/go/internal/raw holds and that only the
 * idiomatic package bindings/go uses:
 *   - fixed-width integers keep their width in Go (stdint.i alone makes uint32_t a Go uint, which
 *     a uint32_t * out-parameter would only half fill);
 *   - handles are uintptr values, out-handles *uintptr: they are opaque integers, never pointers;
 *   - caller buffers are *byte / *uint32 / *float32 so Go passes memory it owns for the call only;
 *   - every call without an sg_error_info_t *err gets a shim sgo_<fn>(..., err) that reads
 *     sg_last_error_message() in the same native call as the failing function (a goroutine may
 *     move to another OS thread between two cgo calls, and the message is per thread); the
 *     originals are left out of the raw layer so Go cannot call them by mistake;
 *   - the selector, attention and provider-query calls are not bound in Go yet, so they are left
 *     out too (a shim comes with them when they are);
 *   - the option fields that hold borrowed strings or pointers are set by shims for the duration
 *     of the call, never stored by a SWIG setter (which would leak a copy, or keep a Go pointer in
 *     C memory). */

%{
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
%}

/* ---- integers --------------------------------------------------------------------------------- */
%typemap(gotype) uint8_t, const uint8_t & "uint8"
%typemap(gotype) uint16_t, const uint16_t & "uint16"
%typemap(gotype) int32_t, const int32_t & "int32"
%typemap(gotype) uint32_t, const uint32_t & "uint32"
%typemap(gotype) uint64_t, const uint64_t & "uint64"
%typemap(gotype) size_t, const size_t & "uint64"
%typemap(gotype) uintptr_t, const uintptr_t & "uintptr"

%typemap(gotype) uint16_t * "*uint16"
%typemap(gotype) int32_t * "*int32"
%typemap(gotype) uint32_t *, const uint32_t * "*uint32"
%typemap(gotype) uint64_t * "*uint64"
%typemap(gotype) size_t * "*uint64"
%typemap(gotype) int * "*int32"
%typemap(gotype) float *, const float * "*float32"
%typemap(gotype) uint8_t * "*byte"
/* Caller buffers and borrowed bytes (notifications, metadata blobs, text). */
%typemap(gotype) void *buf, const void *data, const void *blob, char *buf, char *msg "*byte"
%typemap(in) char *buf, char *msg %{ $1 = *($&1_ltype)&$input; %}
%typemap(freearg) char *buf, char *msg ""

/* ---- handles ---------------------------------------------------------------------------------- */
%define SGO_HANDLE(T)
%typemap(gotype) T "uintptr"
%typemap(in) T %{ $1 = ($1_ltype)$input; %}
%typemap(out) T %{ $result = $1; %}
%typemap(goout) T ""
%typemap(gotype) T * "*uintptr"
%enddef
SGO_HANDLE(sg_context_t)
SGO_HANDLE(sg_kv_handle_t)
SGO_HANDLE(sg_listener_t)
SGO_HANDLE(sg_session_t)
SGO_HANDLE(sg_transfer_t)
SGO_HANDLE(sg_profile_t)
SGO_HANDLE(sg_selector_t)
SGO_HANDLE(sg_directory_t)

/* ---- fields set only through the shims below -------------------------------------------------- */
%ignore sg_context_options::provider;
%ignore sg_context_options::local_addr;
%ignore sg_context_options::auth_key;
%ignore sg_context_options::auth_key_len;
%ignore sg_context_options::log_fn;
%ignore sg_context_options::log_user;
%ignore sg_context_options::event_fn;
%ignore sg_context_options::event_user;
%ignore sg_session_options::provider;
%ignore sg_transfer_options::layer_order;
%ignore sg_transfer_options::layer_order_count;
%ignore sg_kv_layout::layer_k_base;
%ignore sg_kv_layout::layer_v_base;
%ignore sg_kv_layout::layer_base_count;
/* Read in C by the event trampoline of the Go package, which gets the struct itself. */
%ignore sg_event;
/* Per-thread state, unsafe to read from Go (see above); the shims read it. */
%ignore sg_last_error_message;
/* Not bound in Go yet (see above). The layer-written call of device engines (queries in device
 * memory) is C and Rust only for now. */
%ignore sg_layer_written;
%ignore sg_layer_written_init;
%ignore sg_transfer_layer_written_ex;
%ignore sg_provider_query;
%ignore sg_provider_info;
%ignore sg_param_bounds;
%ignore sg_selector_create;
%ignore sg_selector_destroy;
%ignore sg_selector_digest_floats;
%ignore sg_selector_digest;
%ignore sg_selector_input;
%ignore sg_selector_input_init;
%ignore sg_selector_select;
%ignore sg_selector_budget_blocks;
%ignore sg_attention_merge;
%ignore sg_attention_finish;
/* The cluster directory (0.4): Go calls it through the sgo_directory_* shims below. */
%ignore sg_directory_s;
%ignore sg_directory_options;
%ignore sg_directory_options_init;
%ignore sg_directory_options_init_sized;
%ignore sg_directory_open;
%ignore sg_directory_publish;
%ignore sg_directory_unpublish;
%ignore sg_directory_lookup;
%ignore sg_directory_list;
%ignore sg_directory_wait;
%ignore sg_directory_connect;
%ignore sg_directory_accept;
%ignore sg_directory_stats;
%ignore sg_directory_stats_init;
%ignore sg_directory_stats_init_sized;
%ignore sg_directory_destroy;
/* Replaced by the versions that take the strings and pointers for the call. */
%ignore sg_context_create;
%ignore sg_session_accept;
%ignore sg_session_connect;
%ignore sg_session_from_metadata;
%ignore sg_transfer_expect;
%ignore sg_transfer_post;

%{
/* Fills err from this thread's last error when the call failed. Used only for calls without an err
 * of their own, so it always overwrites: the Go side reuses error infos without clearing them (the
 * calls that take an err always fill it when they fail). */
static sg_status_t sgo_capture(sg_status_t status, sg_error_info_t *err)
{
    if (status < 0 && err != NULL) {
        err->status = status;
        snprintf(err->message, sizeof err->message, "%s", sg_last_error_message());
    }
    return status;
}

/* Go's zero value "" means the field's default, which the C API spells NULL. */
static const char *sgo_optional(const char *s)
{
    return s != NULL && s[0] != '\0' ? s : NULL;
}

static void sgo_session_options(sg_session_options_t *o, const char *provider)
{
    sg_session_options_init(o);
    o->provider = sgo_optional(provider);
}
%}

/* The shims below name the header's types, so the header is read here, after the typemaps and
 * ignores above; smartgen.i's own %include of it is then a no-op (SWIG reads a file once). */
%include <smartgen/smartgen.h>

/* sgo_FN(PARAMS..., sg_error_info_t *err): FN(ARGS) with its failure captured into err. */
%define SGO_CAPTURE(FN, PARAMS, ARGS)
%ignore FN;
%inline %{
sg_status_t sgo_##FN PARAMS { return sgo_capture(FN ARGS, err); }
%}
%enddef

/* ---- shims for the calls whose options carry strings or pointers ------------------------------ */
%inline %{
/* The cluster directory: options as arguments ("" and 0 are the defaults), every call capturing its
 * message in the same native call. */
sg_status_t sgo_directory_open(sg_context_t ctx, const char *endpoints, const char *prefix, uint32_t lease_ttl_ms,
                               uint32_t request_timeout_ms, sg_directory_t *out, sg_error_info_t *err)
{
    sg_directory_options_t o;
    sg_directory_options_init(&o);
    o.endpoints = endpoints;
    o.prefix = prefix != NULL && prefix[0] != 0 ? prefix : NULL;
    o.lease_ttl_ms = lease_ttl_ms;
    o.request_timeout_ms = request_timeout_ms;
    return sg_directory_open(ctx, &o, out, err);
}
sg_status_t sgo_directory_publish(sg_directory_t dir, const char *name, uint64_t timeout_ns, sg_error_info_t *err)
{
    return sgo_capture(sg_directory_publish(dir, name, timeout_ns), err);
}
sg_status_t sgo_directory_unpublish(sg_directory_t dir, const char *name, uint64_t timeout_ns, sg_error_info_t *err)
{
    return sgo_capture(sg_directory_unpublish(dir, name, timeout_ns), err);
}
sg_status_t sgo_directory_lookup(sg_directory_t dir, const char *name, uint64_t timeout_ns, void *buf, size_t cap,
                                 size_t *len, sg_error_info_t *err)
{
    return sgo_capture(sg_directory_lookup(dir, name, timeout_ns, buf, cap, len), err);
}
sg_status_t sgo_directory_list(sg_directory_t dir, const char *prefix, uint64_t timeout_ns, void *buf, size_t cap,
                               size_t *len, size_t *count, sg_error_info_t *err)
{
    return sgo_capture(sg_directory_list(dir, prefix, timeout_ns, (char *)buf, cap, len, count), err);
}
sg_status_t sgo_directory_wait(sg_directory_t dir, const char *name, int32_t present, uint64_t timeout_ns,
                               sg_error_info_t *err)
{
    return sgo_capture(sg_directory_wait(dir, name, present, timeout_ns), err);
}
/* The statistics as eight counters in the caller's array, in sg_directory_stats_t's order. */
sg_status_t sgo_directory_stats(sg_directory_t dir, uint64_t *counters, sg_error_info_t *err)
{
    sg_directory_stats_t s;
    sg_directory_stats_init(&s);
    sg_status_t st = sgo_capture(sg_directory_stats(dir, &s), err);
    if (st == SG_OK) {
        counters[0] = s.requests;
        counters[1] = s.failovers;
        counters[2] = s.keepalives;
        counters[3] = s.leases_granted;
        counters[4] = s.sessions_accepted;
        counters[5] = s.requests_refused;
        counters[6] = s.names_taken_over;
        counters[7] = s.names_restored;
    }
    return st;
}
sg_status_t sgo_directory_connect(sg_directory_t dir, const char *name, uint64_t timeout_ns, sg_session_t *out,
                                  sg_error_info_t *err)
{
    return sg_directory_connect(dir, name, NULL, timeout_ns, out, err);
}
sg_status_t sgo_directory_accept(sg_directory_t dir, uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err)
{
    return sg_directory_accept(dir, timeout_ns, out, err);
}
sg_status_t sgo_directory_destroy(sg_directory_t dir, sg_error_info_t *err)
{
    return sgo_capture(sg_directory_destroy(dir), err);
}

/* sg_transfer_layer_written_ex with its struct's fields as arguments: host queries as a pointer cgo
 * pins for the call (the library copies them), device queries and the stream as addresses. */
sg_status_t sgo_transfer_layer_written_ex(sg_transfer_t xfer, uint32_t layer, const float *host_queries,
                                          uintptr_t device_queries, uint32_t num_queries, uint32_t num_q_heads,
                                          uint32_t queries_mem_kind, uintptr_t cuda_stream, sg_error_info_t *err)
{
    sg_layer_written_t a;
    sg_layer_written_init(&a);
    a.queries = host_queries != NULL ? host_queries : (const float *)device_queries;
    a.num_queries = num_queries;
    a.num_q_heads = num_q_heads;
    a.queries_mem_kind = queries_mem_kind;
    a.cuda_stream = (void *)cuda_stream;
    return sgo_capture(sg_transfer_layer_written_ex(xfer, layer, &a), err);
}

/* Options as sg_context_options_t plus its borrowed fields; "" and 0 mean the defaults. The event
 * callback is a C function address the Go package passes as an integer (its cgo trampoline). */
sg_status_t sgo_context_create(sg_context_options_t *options, const char *provider, const char *local_addr,
                               const char *auth_key, size_t auth_key_len, uintptr_t event_fn,
                               uintptr_t event_user, sg_context_t *out, sg_error_info_t *err)
{
    sg_context_options_t o = *options;
    o.provider = sgo_optional(provider);
    o.local_addr = sgo_optional(local_addr);
    o.auth_key = auth_key_len > 0 ? auth_key : NULL;
    o.auth_key_len = auth_key_len;
    o.event_fn = (sg_event_fn)event_fn;
    o.event_user = (void *)event_user;
    return sg_context_create(&o, out, err);
}

sg_status_t sgo_session_accept(sg_listener_t listener, const char *provider, uint64_t timeout_ns,
                               sg_session_t *out, sg_error_info_t *err)
{
    sg_session_options_t o;
    sgo_session_options(&o, provider);
    return sg_session_accept(listener, &o, timeout_ns, out, err);
}

sg_status_t sgo_session_connect(sg_context_t ctx, const char *addr, uint16_t port, const char *provider,
                                uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err)
{
    sg_session_options_t o;
    sgo_session_options(&o, provider);
    return sg_session_connect(ctx, addr, port, &o, timeout_ns, out, err);
}

sg_status_t sgo_session_from_metadata(sg_context_t ctx, const void *blob, size_t len, const char *provider,
                                      sg_session_t *out, sg_error_info_t *err)
{
    sg_session_options_t o;
    sgo_session_options(&o, provider);
    return sg_session_from_metadata(ctx, blob, len, &o, out, err);
}

/* Expect (post = 0) or post (post = 1) with options plus the layer order, borrowed for the call. */
sg_status_t sgo_transfer_start(int post, sg_session_t session, const char *request_id, sg_kv_handle_t kv,
                               const uint32_t *block_ids, size_t num_blocks, uint64_t num_tokens,
                               const sg_transfer_options_t *options, const uint32_t *layer_order,
                               size_t layer_order_count, sg_transfer_t *out, sg_error_info_t *err)
{
    sg_transfer_options_t o = *options;
    o.layer_order = layer_order_count > 0 ? layer_order : NULL;
    o.layer_order_count = layer_order_count;
    return post ? sg_transfer_post(session, request_id, kv, block_ids, num_blocks, num_tokens, &o, out, err)
                : sg_transfer_expect(session, request_id, kv, block_ids, num_blocks, num_tokens, &o, out, err);
}

/* sg_transfer_layer_state with the state as the result (>= 0), or the failure status (< 0): no
 * out-parameter, so the Go call passes no pointer and allocates nothing on the path hosts poll. */
int64_t sgo_transfer_layer_state_value(sg_transfer_t xfer, uint32_t layer, sg_error_info_t *err)
{
    uint32_t state = 0;
    sg_status_t status = sgo_capture(sg_transfer_layer_state(xfer, layer, &state), err);
    return status < 0 ? (int64_t)status : (int64_t)state;
}

/* The stats structs share their names with the functions that fill them (sg_transfer_stats), so
 * SWIG makes no constructor for them: these allocate one, initialised (free with the Delete). */
sg_transfer_stats_t *sgo_transfer_stats_new(void)
{
    sg_transfer_stats_t *s = (sg_transfer_stats_t *)malloc(sizeof *s);
    if (s != NULL)
        sg_transfer_stats_init(s);
    return s;
}

sg_context_stats_t *sgo_context_stats_new(void)
{
    sg_context_stats_t *s = (sg_context_stats_t *)malloc(sizeof *s);
    if (s != NULL)
        sg_context_stats_init(s);
    return s;
}

/* The per-layer base pointers of a layout live in C arrays owned by the Go Pool (the library keeps
 * the layout's pointers, and Go memory must not hold them past a call). */
void **sgo_pointers_new(size_t count) { return (void **)calloc(count ? count : 1, sizeof(void *)); }
void sgo_pointers_set(void **array, size_t i, uintptr_t address) { array[i] = (void *)address; }
void sgo_pointers_free(void **array) { free(array); }
void sgo_kv_layout_set_bases(sg_kv_layout_t *layout, void **k, void **v, size_t count)
{
    layout->layer_k_base = (void *const *)k;
    layout->layer_v_base = (void *const *)v;
    layout->layer_base_count = count;
}
%}

/* ---- shims for the calls without err ---------------------------------------------------------- */
SGO_CAPTURE(sg_context_destroy, (sg_context_t ctx, sg_error_info_t *err), (ctx))
SGO_CAPTURE(sg_context_event_fd, (sg_context_t ctx, int *fd, sg_error_info_t *err), (ctx, fd))
SGO_CAPTURE(sg_context_progress, (sg_context_t ctx, sg_error_info_t *err), (ctx))
SGO_CAPTURE(sg_context_provider, (sg_context_t ctx, char *buf, size_t cap, sg_error_info_t *err), (ctx, buf, cap))
SGO_CAPTURE(sg_context_set_param, (sg_context_t ctx, sg_param_t param, uint64_t value, sg_error_info_t *err),
            (ctx, param, value))
SGO_CAPTURE(sg_context_get_param, (sg_context_t ctx, sg_param_t param, uint64_t *value, sg_error_info_t *err),
            (ctx, param, value))
SGO_CAPTURE(sg_context_stats, (sg_context_t ctx, sg_context_stats_t *out, sg_error_info_t *err), (ctx, out))
SGO_CAPTURE(sg_context_metrics_text, (sg_context_t ctx, char *buf, size_t cap, size_t *len, sg_error_info_t *err),
            (ctx, buf, cap, len))
SGO_CAPTURE(sg_context_get_metadata, (sg_context_t ctx, void *buf, size_t cap, size_t *len, sg_error_info_t *err),
            (ctx, buf, cap, len))
SGO_CAPTURE(sg_kv_layout_plane_bytes, (const sg_kv_layout_t *layout, uint64_t *bytes, sg_error_info_t *err),
            (layout, bytes))
SGO_CAPTURE(sg_kv_layout_region_bytes, (const sg_kv_layout_t *layout, uint64_t *bytes, sg_error_info_t *err),
            (layout, bytes))
SGO_CAPTURE(sg_kv_deregister, (sg_kv_handle_t handle, sg_error_info_t *err), (handle))
SGO_CAPTURE(sg_listener_port, (sg_listener_t listener, uint16_t *port, sg_error_info_t *err), (listener, port))
SGO_CAPTURE(sg_listener_destroy, (sg_listener_t listener, sg_error_info_t *err), (listener))
SGO_CAPTURE(sg_session_wait_ready, (sg_session_t session, uint64_t timeout_ns, sg_error_info_t *err),
            (session, timeout_ns))
SGO_CAPTURE(sg_session_export_kv, (sg_session_t session, sg_kv_handle_t handle, sg_error_info_t *err),
            (session, handle))
SGO_CAPTURE(sg_session_provider, (sg_session_t session, char *buf, size_t cap, sg_error_info_t *err),
            (session, buf, cap))
SGO_CAPTURE(sg_session_notify, (sg_session_t session, const void *data, size_t len, sg_error_info_t *err),
            (session, data, len))
SGO_CAPTURE(sg_session_next_notification,
            (sg_session_t session, void *buf, size_t cap, size_t *len, sg_error_info_t *err),
            (session, buf, cap, len))
SGO_CAPTURE(sg_session_error, (sg_session_t session, sg_status_t *status, char *msg, size_t cap, sg_error_info_t *err),
            (session, status, msg, cap))
SGO_CAPTURE(sg_session_close, (sg_session_t session, uint64_t timeout_ns, sg_error_info_t *err),
            (session, timeout_ns))
SGO_CAPTURE(sg_session_destroy, (sg_session_t session, sg_error_info_t *err), (session))
SGO_CAPTURE(sg_profile_to_json, (sg_profile_t profile, char *buf, size_t cap, size_t *len, sg_error_info_t *err),
            (profile, buf, cap, len))
SGO_CAPTURE(sg_profile_destroy, (sg_profile_t profile, sg_error_info_t *err), (profile))
SGO_CAPTURE(sg_transfer_layer_written, (sg_transfer_t xfer, uint32_t layer, sg_error_info_t *err),
            (xfer, layer, NULL))
SGO_CAPTURE(sg_transfer_layer_written_q,
            (sg_transfer_t xfer, uint32_t layer, const float *queries, uint32_t num_queries, uint32_t num_q_heads,
             sg_error_info_t *err),
            (xfer, layer, queries, num_queries, num_q_heads))
SGO_CAPTURE(sg_transfer_wait_layer_state,
            (sg_transfer_t xfer, uint32_t layer, uint32_t bits, uint64_t timeout_ns, sg_error_info_t *err),
            (xfer, layer, bits, timeout_ns))
SGO_CAPTURE(sg_transfer_digests,
            (sg_transfer_t xfer, uint32_t layer, float *out, size_t cap, size_t *count, sg_error_info_t *err),
            (xfer, layer, out, cap, count))
SGO_CAPTURE(sg_transfer_fetch,
            (sg_transfer_t xfer, uint32_t layer, const uint32_t *blocks, size_t count, sg_error_info_t *err),
            (xfer, layer, blocks, count))
SGO_CAPTURE(sg_transfer_wait_blocks,
            (sg_transfer_t xfer, uint32_t layer, const uint32_t *blocks, size_t count, uint64_t timeout_ns,
             sg_error_info_t *err),
            (xfer, layer, blocks, count, timeout_ns))
SGO_CAPTURE(sg_transfer_test, (sg_transfer_t xfer, sg_error_info_t *err), (xfer))
SGO_CAPTURE(sg_transfer_wait, (sg_transfer_t xfer, uint64_t timeout_ns, sg_error_info_t *err), (xfer, timeout_ns))
SGO_CAPTURE(sg_transfer_wait_layer, (sg_transfer_t xfer, uint32_t layer, uint64_t timeout_ns, sg_error_info_t *err),
            (xfer, layer, timeout_ns))
SGO_CAPTURE(sg_transfer_layer_state, (sg_transfer_t xfer, uint32_t layer, uint32_t *state, sg_error_info_t *err),
            (xfer, layer, state))
SGO_CAPTURE(sg_transfer_residency,
            (sg_transfer_t xfer, uint32_t layer, uint8_t *bitmap, size_t cap, size_t *num_bits, sg_error_info_t *err),
            (xfer, layer, bitmap, cap, num_bits))
SGO_CAPTURE(sg_transfer_status, (sg_transfer_t xfer, sg_status_t *status, char *msg, size_t cap, sg_error_info_t *err),
            (xfer, status, msg, cap))
SGO_CAPTURE(sg_transfer_stats, (sg_transfer_t xfer, sg_transfer_stats_t *out, sg_error_info_t *err), (xfer, out))
SGO_CAPTURE(sg_transfer_layer_time, (sg_transfer_t xfer, uint32_t layer, uint64_t *ns, sg_error_info_t *err),
            (xfer, layer, ns))
SGO_CAPTURE(sg_transfer_cancel, (sg_transfer_t xfer, sg_error_info_t *err), (xfer))
SGO_CAPTURE(sg_transfer_wait_quiesced, (sg_transfer_t xfer, uint64_t timeout_ns, sg_error_info_t *err),
            (xfer, timeout_ns))
SGO_CAPTURE(sg_transfer_release, (sg_transfer_t xfer, sg_error_info_t *err), (xfer))
