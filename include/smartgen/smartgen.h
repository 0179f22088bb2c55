/*
 * SmartGen: KV-cache transfer runtime for disaggregated LLM serving.
 *
 * This header is the whole public contract of libsmartgen.so.0. It is plain C99, includes only
 * <stdint.h> and <stddef.h>, and is read by SWIG and bindgen as it is. docs/abi.md holds the rules
 * of the ABI (what a minor release may change, what never changes) and the reasons for them.
 *
 * Model
 *   sg_context_t   one per engine process: fabric, progress thread, registries, counters.
 *   sg_kv_handle_t a registered paged KV pool (its layout and memory).
 *   sg_session_t   a link to one peer context, made over a bootstrap socket or metadata blobs.
 *   sg_transfer_t  one request's KV: the decode side expects it, the prefill side posts it, the
 *                  runtime matches the two by request id and moves the blocks prefill -> decode.
 *
 * Conventions (apply to every function unless its own comment says otherwise)
 *   - Fallible calls return sg_status_t: SG_OK (0), SG_IN_PROGRESS (1), or a negative error from a
 *     pinned range: -1..-99 caller errors, -100..-199 resources / retry later, -200..-299 peer,
 *     network or deadline, -300..-399 unsupported.
 *   - Outputs are written only when the call returns SG_OK (or SG_IN_PROGRESS where stated), except
 *     the size out-parameter of a caller buffer with SG_ERR_BUFFER_TOO_SMALL (below).
 *   - Caller buffers. A call that fills a caller buffer (buf/out + a capacity) and reports its size
 *     (*len, *count, *num_bits) follows one rule: buffer NULL with capacity 0 asks for the size:
 *     SG_OK, only the size written; buffer NULL with a capacity > 0: SG_ERR_INVALID_ARGUMENT; a
 *     buffer too small: SG_ERR_BUFFER_TOO_SMALL with the size written and the buffer untouched;
 *     otherwise SG_OK with the buffer and the size written. Capacities and sizes count the
 *     function's unit (bytes, floats, entries); text sizes exclude the NUL, which the buffer must
 *     also hold. Calls without a size out-parameter say where the size comes from; optional
 *     error-detail strings (msg, cap) are cut to fit instead, as in sg_error_info_t.
 *   - A call that cannot allocate what it needs (also under an address-space limit, ulimit -v)
 *     returns SG_ERR_NO_MEMORY; it never aborts the process.
 *   - Handles are opaque values, never pointers into the library: a destroyed, double-destroyed or
 *     made-up handle, or a handle of another kind, is answered SG_ERR_INVALID_HANDLE. A slot that is
 *     reused gets a new generation, so an old handle value stays invalid. Every destroy call
 *     accepts NULL.
 *   - Strings passed in are borrowed for the duration of the call only, unless stated.
 *   - Timeouts are in nanoseconds. A call that waits returns SG_ERR_TIMEOUT when its timeout passes
 *     first, and nothing else: the object is as it was and the call may be repeated (timeout 0
 *     polls). SG_IN_PROGRESS comes only from the calls that do not wait (sg_transfer_test,
 *     sg_transfer_status). A transfer never fails with SG_ERR_TIMEOUT itself (a missed deadline is
 *     SG_ERR_DEADLINE), so SG_ERR_TIMEOUT from a transfer wait always means the wait's own timeout.
 *   - Option structs (sg_context_options_t, sg_session_options_t, sg_transfer_options_t): a field
 *     left 0 (or NULL) means its default, so a zeroed struct with struct_size set is valid and a
 *     binding's zero value is the default; a behaviour that is not the default has a non-zero
 *     value (e.g. SG_PROGRESS_SPIN_NONE, manual_progress = 1). The KV layout is a description of
 *     memory, not options: each of its fields means the value written, 0 included. Tunables
 *     (sg_context_set_param) also take the value itself, within sg_param_bounds.
 *   - Structs that start with struct_size are initialised by their sg_X_init(p), a macro (since
 *     0.5) calling sg_X_init_sized(p, sizeof *(p)): the library writes exactly the bytes the caller
 *     compiled (its defaults for the fields it knows, zeros past them) and records that size, and
 *     reads and writes such a struct only up to min(struct_size, its own size). So a program built
 *     against an older or newer header than the library's never has a byte written past its
 *     struct. The functions of the plain names stay for programs built against headers before 0.5
 *     and write no more than their struct's first layout in this SONAME (0.2's; fields appended
 *     since keep their defaults: rebuild with this header to set them). Binding generators that
 *     skip macros call the _sized functions with the struct size they bind.
 *   - Public structs hold only fixed-width integers, size_t, pointers and char arrays: no enum and
 *     no bool (their size is the compiler's choice and they bind poorly through SWIG and JNI).
 *     The enums below only name constants; the typedefs that carry them are fixed-width integers.
 *   - Statuses are int32_t values from pinned ranges (below); a newer library may return codes an
 *     older caller does not know: treat an unknown negative code by its range (-1..-99 a caller
 *     error, -100..-199 retry later, -200..-299 the peer or network, -300..-399 unsupported, others
 *     as SG_ERR_INTERNAL) and keep its number; sg_status_str gives "SG_STATUS_UNKNOWN" for it.
 *   - Error detail. The calls that create an object, connect, or check input a caller builds
 *     (contexts, KV registrations and layouts, listeners, sessions, expects and posts, profiles,
 *     selectors) take an optional sg_error_info_t *err: their failures need a sentence to be fixed
 *     (which field, which peer, which errno) and bindings wrap them most. The other calls fail for
 *     reasons their status and handle already say (SG_ERR_INVALID_HANDLE, SG_ERR_OUT_OF_RANGE, a
 *     transfer's own error, read with sg_transfer_status); their detail is in the calling thread's
 *     sg_last_error_message. A binding whose threads move (a goroutine may change OS thread between
 *     two cgo calls) reads that message inside the same native call as the failing function.
 *   - Handles are 64-bit values (a slot and a generation); the library is built and supported on
 *     64-bit targets only, and this header refuses to compile elsewhere.
 *   - Thread safety: every function may be called from any thread, concurrently with any other.
 *     A call that races with the destroy/release of the handle it uses either completes or returns
 *     SG_ERR_INVALID_HANDLE; it never touches freed memory. The one exception is
 *     sg_context_destroy, which must not run concurrently with any call on the context's objects.
 *   - fork(): a context belongs to the process that created it. In a child, every handle inherited
 *     across fork() is invalid (SG_ERR_INVALID_HANDLE: the progress thread and fabric state do not
 *     follow), and the parent's objects are neither used nor destroyed there: their memory and
 *     descriptors are left to the child's exit. A child may create its own context, and exits
 *     normally (exit() or returning from main) with or without one. Descriptors the library opens
 *     are close-on-exec.
 *   - "Since" gives the library version that introduced the function.
 *   - Not provided in this version: confidentiality and integrity of data on the wire once a
 *     session is authenticated (see auth_key); run sessions on a private network.
 */
#ifndef SMARTGEN_SMARTGEN_H
#define SMARTGEN_SMARTGEN_H

#include <stddef.h>
#include <stdint.h>

#if !defined(SWIG) && (!defined(UINTPTR_MAX) || UINTPTR_MAX != 0xFFFFFFFFFFFFFFFFu)
#error "SmartGen supports 64-bit targets only: its handles carry a 64-bit slot and generation"
#endif

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SMARTGEN_BUILDING_LIBRARY)
#define SG_API __attribute__((visibility("default")))
#else
#define SG_API
#endif

/* ---------------------------------------------------------------------------------------------
 * Versions
 * ------------------------------------------------------------------------------------------- */
#define SG_VERSION_MAJOR 0
#define SG_VERSION_MINOR 5
#define SG_VERSION_PATCH 0
#define SG_VERSION_NUMBER (SG_VERSION_MAJOR * 10000 + SG_VERSION_MINOR * 100 + SG_VERSION_PATCH)
/* The SONAME major: libsmartgen.so.<SG_ABI_VERSION>. */
#define SG_ABI_VERSION 0

/* Version of the library actually loaded, as SG_VERSION_NUMBER. Since 0.1. Thread-safe. */
SG_API uint32_t sg_version_number(void);
/* "MAJOR.MINOR.PATCH" of the loaded library; static storage, never freed. Since 0.1. */
SG_API const char *sg_version_string(void);
/* The loaded library's ABI (SONAME) major. Since 0.1. */
SG_API uint32_t sg_abi_version(void);

/* ---------------------------------------------------------------------------------------------
 * Statuses. Values are pinned and never renumbered; an int32_t so that any value, also one a later
 * library adds, is a valid sg_status_t in every language (see Conventions).
 * ------------------------------------------------------------------------------------------- */
typedef int32_t sg_status_t;
enum sg_status_code {
    SG_OK = 0,
    SG_IN_PROGRESS = 1,
    /* -1..-99: the caller passed something wrong; fix the call. */
    SG_ERR_INVALID_ARGUMENT = -1,
    SG_ERR_INVALID_HANDLE = -2,
    SG_ERR_INVALID_LAYOUT = -3,
    SG_ERR_LAYOUT_MISMATCH = -4,
    SG_ERR_OUT_OF_RANGE = -5,
    SG_ERR_BUFFER_TOO_SMALL = -6,
    SG_ERR_INVALID_STATE = -7,
    SG_ERR_DUPLICATE = -8,
    SG_ERR_VERSION_MISMATCH = -9,
    SG_ERR_NOT_FOUND = -10,
    /* -100..-199: resources; retry later or with less. */
    SG_ERR_NO_MEMORY = -100,
    SG_ERR_AGAIN = -101,
    SG_ERR_TIMEOUT = -102,
    SG_ERR_CANCELED = -103,
    /* -200..-299: the peer, the network, or a deadline. */
    SG_ERR_TRANSPORT = -200,
    SG_ERR_PEER_LOST = -201,
    SG_ERR_PROTOCOL = -202,
    SG_ERR_DEADLINE = -203,
    SG_ERR_CONNECT = -204,
    SG_ERR_REMOTE = -205,
    /* The peer's key proof did not match this context's key, or the peer rejected ours. */
    SG_ERR_AUTH_FAILED = -206,
    /* One side has an authentication key and the other none (or, at sg_context_create, neither a
     * key nor allow_unauthenticated was given). */
    SG_ERR_AUTH_REQUIRED = -207,
    /* The prefill side no longer holds the request's blocks (its lease ended): an on-demand fetch
     * cannot be served. The decode side keeps what it holds. */
    SG_ERR_LEASE_EXPIRED = -208,
    /* -300..-399: not supported here (build, provider, memory kind). */
    SG_ERR_UNSUPPORTED = -300,
    SG_ERR_NO_PROVIDER = -301,
    SG_ERR_INTERNAL = -399
};

/* Static name of a status ("SG_ERR_TIMEOUT"); "SG_STATUS_UNKNOWN" for a value this library does not
 * know. Since 0.1. */
SG_API const char *sg_status_str(sg_status_t status);

/* Detail of the most recent failing call made by this thread; "" when none. Successful calls leave
 * it unchanged. The pointer stays valid until this thread's next failing call. Since 0.1. */
SG_API const char *sg_last_error_message(void);

/* Optional per-call error detail for bindings. Initialise with sg_error_info_init; the library
 * writes status and message when the call fails and leaves the struct untouched on success. */
#define SG_ERROR_MESSAGE_MAX 512
typedef struct sg_error_info {
    size_t struct_size;
    sg_status_t status;
    char message[SG_ERROR_MESSAGE_MAX];
} sg_error_info_t;

/* Sets struct_size and clears the rest. Since 0.1. */
SG_API void sg_error_info_init(sg_error_info_t *err);
SG_API void sg_error_info_init_sized(sg_error_info_t *err, size_t size); /* Since 0.5. */
#define sg_error_info_init(err) sg_error_info_init_sized((err), sizeof *(err))

/* ---------------------------------------------------------------------------------------------
 * Enumerations used in layouts and options. Values pinned.
 * ------------------------------------------------------------------------------------------- */
typedef uint32_t sg_dtype_t;
enum sg_dtype {
    SG_DTYPE_FP32 = 0,
    SG_DTYPE_FP16 = 1,
    SG_DTYPE_BF16 = 2,
    SG_DTYPE_FP8_E4M3 = 3
};

/* Size in bytes of one element of dtype, 0 for an unknown value. Since 0.1. */
SG_API size_t sg_dtype_size(sg_dtype_t dtype);

typedef uint32_t sg_mem_kind_t;
enum sg_mem_kind {
    SG_MEM_HOST = 0,
    SG_MEM_CUDA = 1 /* device memory on CUDA device sg_kv_layout_t.device */
};

/* Where K and V of one block live. */
typedef uint32_t sg_kv_packing_t;
enum sg_kv_packing {
    SG_KV_SEPARATE = 0, /* K in layer_k_base[l], V in layer_v_base[l], same block ids */
    SG_KV_FUSED = 1     /* one block holds K then V: [K plane][V plane] at layer_k_base[l] */
};

/* Order of the elements inside one K (or V) plane of a block. */
typedef uint32_t sg_block_order_t;
enum sg_block_order {
    SG_BLOCK_TOKEN_MAJOR = 0, /* [token][kv_head][head_dim] (vLLM-style) */
    SG_BLOCK_HEAD_MAJOR = 1   /* [kv_head][token][head_dim] */
};

/* ---------------------------------------------------------------------------------------------
 * Context
 * ------------------------------------------------------------------------------------------- */
typedef struct sg_context_s *sg_context_t;
typedef struct sg_kv_handle_s *sg_kv_handle_t;
typedef struct sg_listener_s *sg_listener_t;
typedef struct sg_session_s *sg_session_t;
typedef struct sg_transfer_s *sg_transfer_t;

/* Kinds of transfer events, for the optional callback (sg_context_options_t.event_fn). A newer
 * library may add kinds: a callback ignores the kinds it does not know. */
typedef uint32_t sg_event_kind_t;
enum sg_event_kind {
    SG_EVENT_LAYER_READY = 1, /* a layer is complete on this side: decode, its bytes are in place;
                                 prefill, its writes completed */
    SG_EVENT_FINISHED = 2,    /* the transfer finished; status says how */
    SG_EVENT_QUIESCED = 3,    /* the transfer is quiesced (sg_transfer_wait_quiesced): its blocks may
                                 be reused */
    SG_EVENT_ESSENTIAL_READY = 4, /* decode: a layer's proactive blocks and digests are in place;
                                     prefill: they were delivered */
    SG_EVENT_BLOCKS_READY = 5,    /* decode: an on-demand fetch of a layer completed (status says how);
                                     blocks names the logical blocks that fetch asked for */
    SG_EVENT_LEASE_EXPIRED = 6    /* prefill: the request's lease ended before the decode side held
                                     everything; later fetches fail with SG_ERR_LEASE_EXPIRED */
};

/* One transfer event. The library fills struct_size with its own size; fields are only appended,
 * so a callback built against an older header reads the fields it knows. Everything it points to
 * is borrowed for the duration of the callback. Since 0.2. */
typedef struct sg_event {
    size_t struct_size;
    sg_event_kind_t kind;
    uint32_t layer;          /* the layer, for the per-layer kinds; 0 otherwise */
    sg_status_t status;      /* SG_OK, or how the transfer (FINISHED, QUIESCED) or fetch ended */
    uint32_t reserved;       /* 0 */
    sg_transfer_t transfer;
    const char *request_id;  /* NUL-terminated */
    const uint32_t *blocks;  /* SG_EVENT_BLOCKS_READY: the logical blocks of the fetch; else NULL */
    size_t num_blocks;
} sg_event_t;

/* Transfer event callback. Runs on the progress thread (or, without one, inside
 * sg_context_progress or a wait), never with a library lock held, in the order the events happened per
 * transfer. It may call the non-blocking functions of this header — sg_transfer_status/test/
 * layer_state/residency/stats/layer_time, sg_transfer_cancel, sg_transfer_fetch,
 * sg_transfer_layer_written, sg_session_notify, sg_session_next_notification, sg_session_error,
 * sg_context_stats — and must not block: the waiting and tearing-down functions (sg_*_wait*,
 * sg_transfer_release, sg_session_close/destroy, sg_session_accept/connect, sg_context_destroy)
 * return SG_ERR_INVALID_STATE when called from it. Events of a released transfer are not delivered.
 * A wait on a transfer (sg_transfer_wait, _wait_layer, _wait_layer_state, _wait_blocks,
 * _wait_quiesced) returns only once every event the transfer emitted before the wait's condition
 * held has run its callback, so a host may release the transfer right after its wait and miss
 * none (since 0.5; a wait with timeout 0, or one whose timeout passes meanwhile, does not wait for
 * them). Without a progress thread the waiting thread runs them, as sg_context_progress does.
 * Since 0.2 (replaces 0.1's positional sg_transfer_event_fn). */
typedef void (*sg_event_fn)(void *user, const sg_event_t *event);

/* Log levels, most severe first; SG_LOG_DEFAULT (0) in the options means SG_LOG_WARN. Since 0.2
 * the values leave 0 to the default (0.1 had SG_LOG_OFF = 0 ... SG_LOG_DEBUG = 4). */
typedef uint32_t sg_log_level_t;
enum sg_log_level {
    SG_LOG_DEFAULT = 0,
    SG_LOG_OFF = 1,
    SG_LOG_ERROR = 2,
    SG_LOG_WARN = 3,
    SG_LOG_INFO = 4,
    SG_LOG_DEBUG = 5
};

/* SG_PROGRESS_SPIN_NONE in progress_spin_us: the progress thread blocks at once. */
#define SG_PROGRESS_SPIN_NONE 0xFFFFFFFFu

/* Log sink. Runs on whichever library thread logs (often the progress thread); it must not call
 * back into SmartGen and should return quickly. message is borrowed for the call. */
typedef void (*sg_log_fn)(void *user, sg_log_level_t level, const char *message);

typedef struct sg_context_options {
    size_t struct_size;      /* set by sg_context_options_init; fields are only appended */
    uint32_t header_version; /* SG_VERSION_NUMBER the caller compiled with (set by init) */
    /* Fabric provider: NULL or "auto" ranks what is present (verbs;ofi_rxm, efa, then tcp;ofi_rxm);
     * "tcp" is an alias of "tcp;ofi_rxm"; "shm" forces shared memory (same host only). "" is refused
     * (SG_ERR_INVALID_ARGUMENT). Borrowed. */
    const char *provider;
    /* Address the data endpoint binds to: an IPv4 dotted-quad or IPv6 literal ("fe80::1%eth0" too).
     * NULL means 127.0.0.1: nothing binds to an address the caller did not name, so cross-host use
     * must name the NIC address. A host name or anything else is refused (SG_ERR_INVALID_ARGUMENT
     * naming local_addr), not resolved. Since 0.2: several literals separated by commas name
     * several NICs (rails); the context then stripes over one lane per address at least (see
     * lanes). Borrowed. */
    const char *local_addr;
    /* 0 (default): a library thread drives progress. 1: the host calls sg_context_progress (since
     * 0.2; 0.1 had bool progress_thread). Other values: SG_ERR_INVALID_ARGUMENT. */
    uint32_t manual_progress;
    /* Microseconds the progress thread spins before it blocks; 0 means the default, 50;
     * SG_PROGRESS_SPIN_NONE blocks at once. The environment variable SG_PROGRESS_SPIN_US, read at
     * creation, overrides it (there 0 blocks at once). */
    uint32_t progress_spin_us;
    /* Upper bound on RMA operations in flight per context, at most 4096. 0 means the default, 64. */
    uint32_t max_ops_in_flight;
    /* Log level (SG_LOG_DEFAULT = SG_LOG_WARN; SG_LOG_LEVEL=off|error|warn|info|debug overrides) and
     * sink (NULL = stderr). */
    sg_log_level_t log_level;
    sg_log_fn log_fn;
    void *log_user;
    /* A session whose peer has sent nothing for this long is lost: the session and every pending
     * transfer on it fail with SG_ERR_PEER_LOST. Quiet sessions send a small keep-alive every eighth
     * of it. Default 2000, or the environment's SG_PEER_TIMEOUT_MS (100..3600000; since 0.3); 0
     * means the default. With a peer of 0.5 or later, keep-alives go every eighth of this or of the
     * peer's timeout, whichever is shorter, so two contexts may use different values. On a busy host the silence counted is what this context watched: time in
     * which its own progress thread did not run does not count, and a peer whose frames
     * have been arriving up to G apart may stay silent for up to 3 G, at most 4 times this value.
     * A broken connection reported by the fabric is detected sooner. A context without a progress
     * thread must call sg_context_progress (or wait) well within this time, or its peers will
     * consider it lost. */
    uint32_t peer_timeout_ms;
    /* Payload bytes of RMA writes in flight, per context and per session: the scheduler waits for
     * completions before posting more, so a priority change takes effect within about this much
     * data. Defaults 64 MiB and 32 MiB; 0 means the default. One operation larger than the bound
     * still goes when nothing else is in flight. */
    uint64_t max_bytes_in_flight;
    uint64_t max_session_bytes_in_flight;
    /* Unfinished transfers (posted or expected, not yet complete) a session accepts; beyond it
     * sg_transfer_post and sg_transfer_expect return SG_ERR_AGAIN instead of blocking. Default 1024;
     * 0 means the default. */
    uint32_t max_transfers_per_session;
    /* Authentication. Sessions are authenticated by a pre-shared key of 32 to 4096 bytes: each side
     * proves it holds the key with an HMAC-SHA256 challenge-response bound to fresh nonces from the
     * other side, in both directions, before any memory key of either side is sent. The key comes
     * from auth_key/auth_key_len (copied at creation; the caller may wipe its copy afterwards) or,
     * when auth_key is NULL, from the file named by the environment variable SG_AUTH_KEY_FILE (read
     * once at creation; a trailing newline is not part of the key; a file readable by group or
     * others is logged as a warning). Without a key, sg_context_create fails with
     * SG_ERR_AUTH_REQUIRED unless allow_unauthenticated is true. A context with a key never
     * accepts a peer without one (SG_ERR_AUTH_REQUIRED on both sides); different keys give
     * SG_ERR_AUTH_FAILED on both sides. Not provided: confidentiality or integrity of the KV data
     * and control messages on the wire after authentication — use a private network or the fabric's
     * own protection where that matters. */
    const void *auth_key;
    size_t auth_key_len;
    /* 0 (default): a key is required. 1: run without one (only on a trusted network). */
    uint32_t allow_unauthenticated;
    /* Optional transfer event callback (see sg_event_fn) and its user pointer. */
    sg_event_fn event_fn;
    void *event_user;
    /* Since 0.2. Lanes: endpoints, each with its own connection to a peer and its own thread, that
     * a session's writes are striped over (the one that has least outstanding to that peer takes
     * the next write, so a faster lane carries more); control messages keep to lane 0 and a layer's
     * notice still never overtakes its data. A write that fails on a lane is moved to the others
     * (sg_context_stats: lane_failovers), only once the peer has closed its connection on that
     * lane, so no first copy lands after the moved one (wire 1.6); with a peer of an older wire
     * minor such a write fails instead. Since 0.5, with a 0.5 peer, losing lane 0 loses nothing
     * either: the session's messages move to a live lane, those the peer had not acknowledged are
     * sent again and delivered once, and the peer is told at once; only losing every lane loses
     * the session. Since 0.5, with a peer of wire 1.7, a lane given up comes back once both sides
     * have closed it twice, so a session survives any number of lane resets while one lane is up
     * at a time. 0 = the default: the number of
     * addresses in local_addr when it names several, else 2 on tcp;ofi_rxm (measured: 1.5x the
     * bulk throughput of one on loopback) and 1 on other providers; the environment variable
     * SG_LANES, read at creation, overrides it. Writes under 256 KiB stay on lane 0.
     * At most 16. Two peers use as many lanes as the one with fewer has; a peer before 0.2 uses
     * one. Same-host shm sessions use one lane. Providers that choose their own memory keys
     * (verbs, efa) cannot be striped yet: more than 1 there is SG_ERR_INVALID_ARGUMENT. */
    uint32_t lanes;
} sg_context_options_t;

/* Fills defaults, struct_size and header_version. Since 0.1. */
SG_API void sg_context_options_init(sg_context_options_t *options);
SG_API void sg_context_options_init_sized(sg_context_options_t *options, size_t size); /* Since 0.5. */
#define sg_context_options_init(options) sg_context_options_init_sized((options), sizeof *(options))

/* Creates a context: opens the fabric and, unless disabled, the progress thread. Its endpoints (one
 * per lane) on a network provider open on first use: its first session, listener handshake or
 * metadata blob. Until then a tcp context costs well under 1 MB (after the first in a process); an
 * open tcp;ofi_rxm lane about 70 MB more (the provider's buffers). A shm context opens its endpoint
 * at creation: 4-8 MB (README.md, "What a context costs").
 * An endpoint that cannot open fails that first use
 * (SG_ERR_TRANSPORT), and the next use tries again.
 * options: borrowed, may be NULL for defaults. out: receives the context.
 * Returns SG_OK; SG_ERR_INVALID_ARGUMENT (out NULL, bad field: the message names it, e.g. provider
 * "" or a local_addr that is not an address literal); SG_ERR_VERSION_MISMATCH (header_version has
 * another major); SG_ERR_NO_PROVIDER (the provider asked for is absent, or lacks FI_RMA|FI_MSG on
 * local_addr: the message says why); SG_ERR_TRANSPORT; SG_ERR_NO_MEMORY.
 * Since 0.1. */
SG_API sg_status_t sg_context_create(const sg_context_options_t *options, sg_context_t *out,
                                     sg_error_info_t *err);

/* Destroys a context. Its directory handles are destroyed first (their names withdrawn at once, so
 * no peer is sent to a context that is gone), then sessions, listeners, KV handles and transfers
 * still open are closed (transfers canceled); their handles answer SG_ERR_INVALID_HANDLE after.
 * NULL is accepted. Returns SG_OK or SG_ERR_INVALID_HANDLE. Must not run
 * concurrently with other calls on the same context's objects. Since 0.1. */
SG_API sg_status_t sg_context_destroy(sg_context_t ctx);

/* A file descriptor (an eventfd, close-on-exec, owned by the context: do not close it) that becomes
 * readable whenever something happened that a host may want to look at: a layer became ready, a
 * transfer completed or failed, a session was lost, a notification arrived. Put it in an
 * epoll/poll loop; after it fires, read 8 bytes from it to re-arm, then test the transfers and
 * sessions of interest. Since 0.1. */
SG_API sg_status_t sg_context_event_fd(sg_context_t ctx, int *fd);

/* Drives progress once (poll completions, run the scheduler) without blocking. Needed only when the
 * context was created with progress_thread = false; harmless otherwise. Since 0.1. */
SG_API sg_status_t sg_context_progress(sg_context_t ctx);

/* Name of the provider the context runs on ("tcp;ofi_rxm", "shm", ...), NUL-terminated into buf (cap
 * bytes). No size out-parameter (see Caller buffers): buf NULL is SG_ERR_INVALID_ARGUMENT, a name
 * that does not fit SG_ERR_BUFFER_TOO_SMALL, the message saying the bytes needed. Since 0.1. */
SG_API sg_status_t sg_context_provider(sg_context_t ctx, char *buf, size_t cap);

/* Run-time tunables: constant + value with queryable bounds. Values pinned. */
typedef uint32_t sg_param_t;
enum sg_param {
    /* A layer whose operations average fewer bytes than this is a candidate for the staging path
     * (pack, one large write, unpack); SG_PARAM_STAGING_POLICY decides. 0 = never stage.
     * Default 262144. */
    SG_PARAM_STAGING_THRESHOLD = 0,
    /* Largest single RMA operation after coalescing, bytes (also capped by max_msg_size). */
    SG_PARAM_MAX_OP_BYTES = 1,
    /* RMA operations in flight per context. */
    SG_PARAM_MAX_OPS_IN_FLIGHT = 2,
    /* Progress thread spin before blocking, microseconds. */
    SG_PARAM_PROGRESS_SPIN_US = 3,
    /* How candidate layers are sent: SG_STAGING_AUTO (default) measures the throughput of both
     * paths on each session and uses the faster, re-measuring the other now and then (less often
     * the clearer the winner; one layer at a time measures a path nobody has measured yet, the
     * others meanwhile stage on same-host providers and write directly elsewhere);
     * SG_STAGING_ALWAYS stages every candidate; SG_STAGING_NEVER writes directly. */
    SG_PARAM_STAGING_POLICY = 4
};

#define SG_STAGING_AUTO 0
#define SG_STAGING_ALWAYS 1
#define SG_STAGING_NEVER 2

/* Sets a tunable; SG_ERR_OUT_OF_RANGE outside its bounds, SG_ERR_INVALID_ARGUMENT for an unknown
 * param. Applies to operations scheduled after the call. Since 0.1. */
SG_API sg_status_t sg_context_set_param(sg_context_t ctx, sg_param_t param, uint64_t value);
/* Reads a tunable. Since 0.1. */
SG_API sg_status_t sg_context_get_param(sg_context_t ctx, sg_param_t param, uint64_t *value);
/* Bounds of a tunable (inclusive). Since 0.1. */
SG_API sg_status_t sg_param_bounds(sg_param_t param, uint64_t *min_value, uint64_t *max_value);

/* Context-wide counters since creation; monotonic except sessions_open. */
typedef struct sg_context_stats {
    size_t struct_size;          /* set by sg_context_stats_init */
    uint64_t bytes_direct;       /* payload bytes sent with direct RMA writes */
    uint64_t bytes_staged;       /* payload bytes sent through the staging path */
    uint64_t rma_ops;            /* RMA operations posted */
    uint64_t staging_copies;     /* memcpy calls of staging, pack (prefill) and unpack (decode) */
    uint64_t messages_sent;      /* control messages accepted by the provider */
    uint64_t messages_received;  /* control messages received */
    uint64_t retries;            /* posts the provider answered with EAGAIN, retried later */
    uint64_t transfers_completed;
    uint64_t transfers_failed;   /* any error, including the three below */
    uint64_t transfers_canceled;
    uint64_t deadlines_hit;
    uint64_t peers_lost;         /* sessions lost to silence, a broken connection or the peer's close */
    uint64_t sessions_open;
    uint64_t auth_failures;      /* sessions refused: wrong key, or one side without a key */
    uint64_t stalls;             /* times a transfer with work waited for the in-flight bounds */
    /* Since 0.1.1: memory registrations the context holds now (pools exported to sessions,
     * staging slots); a gauge, not a counter: back to its earlier value once sessions close. */
    uint64_t registrations;
    /* Since 0.2: lanes of the context's network provider (a gauge); writes moved off a failed lane
     * and completed on another; (peer, lane) pairs given up after an error (since 0.5 also those
     * the peer said it gave up: both sides count a broken lane). */
    uint64_t lanes;
    uint64_t lane_failovers;
    uint64_t lanes_lost;
    /* Since 0.5: end-to-end verification, on where either side's environment has
     * SG_TRANSFER_VERIFY=1 at context creation (both sides 0.5; host pools, not quantized on the
     * wire): the prefill side sends the CRC32C of each block's content, and the decode side checks
     * each block once its bytes are in place. Blocks checked (decode side), and those that did not
     * match; a mismatch fails its transfer on both sides with SG_ERR_TRANSPORT naming the layer
     * and block. It costs one read of every byte on each side (docs/benchmarks.md). */
    uint64_t blocks_verified;
    uint64_t verify_mismatches;
} sg_context_stats_t;

/* Sets struct_size and clears the rest. Since 0.1. */
SG_API void sg_context_stats_init(sg_context_stats_t *stats);
SG_API void sg_context_stats_init_sized(sg_context_stats_t *stats, size_t size); /* Since 0.5. */
#define sg_context_stats_init(stats) sg_context_stats_init_sized((stats), sizeof *(stats))

/* Snapshot of the context's counters into *out. Thread-safe; takes the context's lock briefly.
 * Returns SG_OK, SG_ERR_INVALID_HANDLE, SG_ERR_INVALID_ARGUMENT (out NULL or struct_size unset).
 * Since 0.1. */
SG_API sg_status_t sg_context_stats(sg_context_t ctx, sg_context_stats_t *out);

/* The same counters in the Prometheus text exposition format (version 0.0.4), for the host to serve:
 * "smartgen_rma_ops_total 12", with HELP and TYPE lines, NUL-terminated. Caller buffer (see
 * Conventions): *len receives the text's bytes without the NUL, so buf needs cap > *len.
 * Since 0.1. */
SG_API sg_status_t sg_context_metrics_text(sg_context_t ctx, char *buf, size_t cap, size_t *len);

/* ---------------------------------------------------------------------------------------------
 * Providers (what smartgen-info shows)
 * ------------------------------------------------------------------------------------------- */
typedef struct sg_provider_info {
    size_t struct_size;
    char name[64];    /* "tcp;ofi_rxm", "shm", "verbs;ofi_rxm", "efa", ... */
    char fabric[128]; /* fabric name (e.g. the subnet for tcp) */
    char domain[64];  /* domain name (e.g. the interface) */
    uint64_t caps;    /* libfabric FI_* capability bits as reported */
    uint64_t mr_mode; /* libfabric FI_MR_* bits */
    uint64_t msg_order;
    uint64_t max_msg_size;
    uint64_t rma_iov_limit;
    uint64_t inject_size;
    uint32_t usable;        /* 1: has RDM + FI_RMA + FI_MSG and an MR regime SmartGen implements */
    int32_t rank;           /* lower is preferred for a remote peer; -1 when not usable */
    uint32_t chosen_remote; /* 1: the one a context would use for a peer on another host */
    uint32_t chosen_local;  /* 1: the one a session would use for a peer on this host */
    char reason[256];   /* why it was kept, ranked or rejected */
} sg_provider_info_t;

/* Lists the providers libfabric finds, one entry per (provider, domain), ranked as the runtime ranks
 * them. Caller buffer (see Conventions) of capacity entries; *count receives the number found (0,
 * with SG_OK, when there is none). When it exceeds capacity: SG_ERR_BUFFER_TOO_SMALL and no entry
 * is written (the list may change between two calls: retry with the new count). Each
 * out[i].struct_size (i < capacity) must be set by the caller (sizeof(sg_provider_info_t)), else
 * SG_ERR_INVALID_ARGUMENT; the library writes min(struct_size, its size) bytes of each entry.
 * local_addr: reserved, pass NULL. Since 0.1. */
SG_API sg_status_t sg_provider_query(const char *local_addr, sg_provider_info_t *out, size_t capacity,
                                     size_t *count);

/* ---------------------------------------------------------------------------------------------
 * KV layout and handles
 * ------------------------------------------------------------------------------------------- */
typedef struct sg_kv_layout {
    size_t struct_size;        /* set by sg_kv_layout_init */
    uint32_t num_layers;       /* >= 1 */
    uint32_t num_kv_heads;     /* >= 1 */
    uint32_t head_dim;         /* >= 1 */
    uint32_t tokens_per_block; /* >= 1 */
    uint64_t num_blocks;       /* blocks in the pool, per layer */
    sg_dtype_t dtype;
    sg_kv_packing_t packing;
    sg_block_order_t block_order;
    sg_mem_kind_t mem_kind;
    int32_t device;                /* CUDA device ordinal when mem_kind is SG_MEM_CUDA */
    void *const *layer_k_base;     /* num_layers pointers: K (or fused K+V) blocks of each layer */
    void *const *layer_v_base;     /* num_layers pointers for SG_KV_SEPARATE; NULL when fused */
    size_t layer_base_count;       /* entries in each array; must equal num_layers */
    /* Bytes from one block to the next within a layer; 0 = packed (the block's own size). */
    uint64_t block_stride_bytes;
} sg_kv_layout_t;

/* Fills struct_size and defaults (fp16, separate, token-major, host, packed). Since 0.1. */
SG_API void sg_kv_layout_init(sg_kv_layout_t *layout);
SG_API void sg_kv_layout_init_sized(sg_kv_layout_t *layout, size_t size); /* Since 0.5. */
#define sg_kv_layout_init(layout) sg_kv_layout_init_sized((layout), sizeof *(layout))

/* Checks a layout; SG_ERR_INVALID_LAYOUT with a message naming the bad field. Since 0.1. */
SG_API sg_status_t sg_kv_layout_validate(const sg_kv_layout_t *layout, sg_error_info_t *err);

/* Bytes of one K plane of one block (= V plane): tokens_per_block * num_kv_heads * head_dim *
 * dtype size. This and sg_kv_layout_region_bytes read only the shape: the base pointers may be
 * NULL, so a pool can be sized before its memory exists (since 0.2; 0.1 checked them too). Since 0.1. */
SG_API sg_status_t sg_kv_layout_plane_bytes(const sg_kv_layout_t *layout, uint64_t *bytes);

/* Bytes one layer's region spans: num_blocks * stride (fused: K and V together). Since 0.1. */
SG_API sg_status_t sg_kv_layout_region_bytes(const sg_kv_layout_t *layout, uint64_t *bytes);

/* Registers a paged KV pool with the context. The layout is copied (including the base pointers);
 * the memory it points to stays the caller's and must outlive the handle. Memory is registered with
 * the fabric lazily, once per (pool, session), never per block.
 * SG_MEM_CUDA pools (since 0.3) need the CUDA plugin libsmartgen-cuda.so.0 (loaded on first use,
 * beside libsmartgen or SG_CUDA_PLUGIN), a driver and the device; their base pointers must be memory
 * of that device. Where the provider reaches device memory (FI_HMEM with CUDA: GPUDirect RDMA on
 * verbs or EFA) and registers the pool, its bytes move by RMA like host memory; elsewhere
 * (tcp, shm, a provider that refuses the memory, SG_FI_HMEM=0 in the environment) they move through
 * the staging path (the CUDA plugin gathers them into the host's staging slots, or scatters received
 * slots into the pool; docs/cuda.md), whatever the peer's pool is. A CPU selection (digests, SnapKV)
 * reads a host copy of the layer's keys.
 * Returns SG_OK; SG_ERR_INVALID_LAYOUT (message names the field; also a CUDA device ordinal the
 * driver does not have, or a base that is not memory of that device); SG_ERR_UNSUPPORTED for
 * SG_MEM_CUDA, the message naming what is missing (the plugin, a driver, a device);
 * SG_ERR_INVALID_HANDLE; SG_ERR_NO_MEMORY. Since 0.1; SG_MEM_CUDA since 0.3. */
SG_API sg_status_t sg_kv_register(sg_context_t ctx, const sg_kv_layout_t *layout, sg_kv_handle_t *out,
                                  sg_error_info_t *err);

/* Deregisters a pool. Fails with SG_ERR_INVALID_STATE while a transfer that uses it is unreleased.
 * Sessions the pool was exported on that were lost or destroyed were fenced already (see
 * sg_session_destroy): nothing they carried lands in the memory or reads it after SG_OK. NULL
 * accepted. Since 0.1. */
SG_API sg_status_t sg_kv_deregister(sg_kv_handle_t handle);

/* ---------------------------------------------------------------------------------------------
 * Sessions
 * ------------------------------------------------------------------------------------------- */
typedef struct sg_session_options {
    size_t struct_size;
    /* Provider for this session when the context opened more than one; NULL = automatic (shm for a
     * peer on this host and network namespace when the context has it, else the context's first). */
    const char *provider;
} sg_session_options_t;

/* Fills struct_size and defaults. Since 0.1. */
SG_API void sg_session_options_init(sg_session_options_t *options);
SG_API void sg_session_options_init_sized(sg_session_options_t *options, size_t size); /* Since 0.5. */
#define sg_session_options_init(options) sg_session_options_init_sized((options), sizeof *(options))

/* Listens for bootstrap connections on addr:port (addr an IPv4/IPv6 literal the caller names; port 0
 * picks a free one, read it with sg_listener_port). The socket is close-on-exec.
 * Returns SG_OK, SG_ERR_INVALID_ARGUMENT, SG_ERR_CONNECT (bind/listen failed: message has errno
 * text). Since 0.1. */
SG_API sg_status_t sg_listener_create(sg_context_t ctx, const char *addr, uint16_t port,
                                      sg_listener_t *out, sg_error_info_t *err);
/* The port the listener is bound to. Since 0.1. */
SG_API sg_status_t sg_listener_port(sg_listener_t listener, uint16_t *port);
/* Closes the listener; established sessions stay. NULL accepted. Since 0.1. */
SG_API sg_status_t sg_listener_destroy(sg_listener_t listener);

/* Accepts one peer on the listener and runs the bootstrap exchange (protocol version, endpoint
 * names) and, with a key, the challenge-response in both directions: the session returned is
 * authenticated. Blocks up to timeout_ns (like every timeout in this header, in nanoseconds).
 * Handshakes run concurrently: the listener accepts every connection that arrives and returns the
 * first whose bootstrap finished. A connection that makes no progress for 4 times the context's
 * peer_timeout_ms (1 time in the first 0.5 builds), or is unfinished after 10 times that, is dropped, and its
 * peer is told why (its connect fails with SG_ERR_TIMEOUT). At most 64 are pending, the
 * oldest silent one making room for a newcomer. A handshake still under way when timeout_ns passes is not aborted: the next call goes
 * on with it, so accepting in short slices is fine. Connections that close or time out before
 * sending a byte do not fail the accept call; a failed handshake of a peer that spoke is returned
 * (SG_ERR_TIMEOUT for one dropped for stalling).
 * Both sides agree on the outcome: when either side cannot open the session (no provider in common,
 * say) both calls fail, with the status of the side that could not (Since 0.2).
 * Returns SG_OK; SG_ERR_TIMEOUT; SG_ERR_VERSION_MISMATCH (peer speaks another protocol major);
 * SG_ERR_AUTH_FAILED (different keys); SG_ERR_AUTH_REQUIRED (one side has no key);
 * SG_ERR_PROTOCOL (malformed message); SG_ERR_NO_PROVIDER; SG_ERR_DUPLICATE (a session with that
 * peer context exists: two contexts hold at most one session between them, however it was made;
 * destroy it first to reconnect); SG_ERR_PEER_LOST. Since 0.1. */
SG_API sg_status_t sg_session_accept(sg_listener_t listener, const sg_session_options_t *options,
                                     uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err);

/* Connects to a listener at addr:port and runs the bootstrap exchange. Blocks up to timeout_ns.
 * Same statuses as sg_session_accept (SG_ERR_DUPLICATE included: one session per pair of
 * contexts), plus SG_ERR_CONNECT. Since 0.1. */
SG_API sg_status_t sg_session_connect(sg_context_t ctx, const char *addr, uint16_t port,
                                      const sg_session_options_t *options, uint64_t timeout_ns,
                                      sg_session_t *out, sg_error_info_t *err);

/* Writes this context's metadata blob (protocol version, endpoint names, host identity) for hosts
 * that carry their own control channel. Caller buffer (see Conventions): *len receives the blob's
 * bytes; buf NULL with cap 0 asks for it. Returns SG_OK, SG_ERR_BUFFER_TOO_SMALL (with *len set),
 * SG_ERR_INVALID_ARGUMENT, SG_ERR_INVALID_HANDLE. Since 0.1. */
SG_API sg_status_t sg_context_get_metadata(sg_context_t ctx, void *buf, size_t cap, size_t *len);

/* Makes a session from a peer's metadata blob. Both sides load the other's blob, within
 * peer_timeout_ms of each other. Messages from the peer that arrive before this call are kept and
 * delivered to the session. With a key, the blob must carry a valid signature, and the session then
 * runs the challenge-response over the fabric before anything else: until both sides have proven
 * the key, no memory key leaves either side and transfers wait (sg_session_wait_ready waits for
 * it). Returns SG_OK; SG_ERR_PROTOCOL (truncated or corrupt blob, bytes past its signature); SG_ERR_VERSION_MISMATCH;
 * SG_ERR_AUTH_FAILED (unsigned blob or signed with another key); SG_ERR_AUTH_REQUIRED (one side
 * has no key); SG_ERR_DUPLICATE (a session with that peer context exists: one session per pair of
 * contexts; several streams between two engines share it). Since 0.1. */
SG_API sg_status_t sg_session_from_metadata(sg_context_t ctx, const void *blob, size_t len,
                                            const sg_session_options_t *options, sg_session_t *out,
                                            sg_error_info_t *err);

/* Waits until the session is authenticated and usable: SG_OK; the session's error when it failed
 * (SG_ERR_AUTH_FAILED when the peer's proof did not match or it rejected ours, SG_ERR_PEER_LOST);
 * SG_ERR_TIMEOUT. Sessions from sg_session_accept/connect are ready at once. Thread-safe.
 * Since 0.1. */
SG_API sg_status_t sg_session_wait_ready(sg_session_t session, uint64_t timeout_ns);

/* Registers a KV pool for this session (a fresh random 64-bit key per region) and sends its
 * descriptor to the peer, which can then address it; no other peer can. Export the destination pool
 * on the decode side before expecting into it; exporting twice is SG_OK and does nothing.
 * Returns SG_OK, SG_ERR_INVALID_HANDLE, SG_ERR_TRANSPORT (registration failed). Since 0.1. */
SG_API sg_status_t sg_session_export_kv(sg_session_t session, sg_kv_handle_t handle);

/* Provider the session runs on, NUL-terminated into buf (cap bytes); as sg_context_provider (no size
 * out-parameter: buf NULL is SG_ERR_INVALID_ARGUMENT). Since 0.1. */
SG_API sg_status_t sg_session_provider(sg_session_t session, char *buf, size_t cap);

#define SG_NOTIFY_MAX 4096 /* bytes of one application notification */

/* Sends a small opaque message (at most SG_NOTIFY_MAX bytes, copied) to the peer, in order with the
 * session's other control messages: the first token, positions, an id, so a host needs no second
 * channel. Returns SG_OK, SG_ERR_INVALID_ARGUMENT (len 0 or > SG_NOTIFY_MAX), SG_ERR_PEER_LOST
 * (session closed or lost), SG_ERR_INVALID_HANDLE. Since 0.1. */
SG_API sg_status_t sg_session_notify(sg_session_t session, const void *data, size_t len);

/* Takes the oldest notification that arrived on the session into buf (cap bytes); *len receives
 * its size. Caller buffer (see Conventions): buf NULL with cap 0 only reports the oldest one's size
 * (SG_OK) and keeps it. Returns SG_OK; SG_ERR_AGAIN when none is waiting (not an error: poll
 * again, or wait for the context's event fd); SG_ERR_BUFFER_TOO_SMALL with *len set and the
 * message kept.
 * At most 4096 notifications wait per session; beyond that the oldest are dropped and counted in
 * the log. Since 0.1. */
SG_API sg_status_t sg_session_next_notification(sg_session_t session, void *buf, size_t cap, size_t *len);

/* Health of a session: *status is SG_OK while it is usable, else why it is not (SG_ERR_PEER_LOST
 * when the peer went silent, its connection broke or it closed the session); msg (optional, cap
 * bytes) receives the detail, cut to fit and NUL-terminated (NULL with cap 0 skips it; NULL with
 * cap > 0 is SG_ERR_INVALID_ARGUMENT). Returns SG_OK, SG_ERR_INVALID_ARGUMENT or
 * SG_ERR_INVALID_HANDLE. Since 0.1. */
SG_API sg_status_t sg_session_error(sg_session_t session, sg_status_t *status, char *msg, size_t cap);

/* Graceful close: the session takes no new transfers (post/expect answer SG_ERR_INVALID_STATE),
 * waits up to timeout_ns until every transfer on it has finished and is quiesced, then tells the
 * peer (whose session then reports SG_ERR_PEER_LOST "peer closed the session" without failing
 * anything), waits (within the same timeout) for the peer to answer, and closes. After SG_OK the
 * process may exit: the peer has read everything this side sent on the session. Returns SG_OK; SG_ERR_TIMEOUT with the session still draining (call again,
 * or sg_session_destroy to cancel what is left); SG_ERR_INVALID_HANDLE. The handle stays valid
 * until sg_session_destroy. Since 0.1. */
SG_API sg_status_t sg_session_close(sg_session_t session, uint64_t timeout_ns);

/* Closes a session at once; its unfinished transfers are canceled. Before it returns, the
 * registrations of the pools exported on it are closed and, unless the close handshake finished
 * (then the peer has stopped writing), every connection to the peer is closed (the fence; over
 * shm, which has none, the registrations close once this side's writes completed): nothing the
 * peer still sends lands in those pools afterwards. NULL accepted. Since 0.1. */
SG_API sg_status_t sg_session_destroy(sg_session_t session);

/* ---------------------------------------------------------------------------------------------
 * Cluster directory (since 0.4): engines publish themselves under a name in an etcd v3 cluster and
 * open sessions to each other by name (docs/directory.md). The blobs there are the contexts'
 * signed metadata: with a session key, an entry written by anyone without the key cannot produce a
 * session (SG_ERR_AUTH_FAILED). Stacks with their own control plane keep using
 * sg_context_get_metadata / sg_session_from_metadata.
 * Timeouts: a call tries the members in turn, each within request_timeout_ms, round after round
 * while they time out or answer 5xx (an election), until its timeout; members that refuse the
 * connection, do not resolve or speak TLS where the URL says http (or the reverse) are passed at
 * once, and when every member failed so the call fails at once with SG_ERR_CONNECT naming each.
 * Timeout 0 polls: each member at most once. An answer over 16 MiB is refused at once
 * (SG_ERR_PROTOCOL), its memory returned.
 * ------------------------------------------------------------------------------------------- */
typedef struct sg_directory_s *sg_directory_t;

typedef struct sg_directory_options {
    size_t struct_size;      /* set by sg_directory_options_init */
    /* The cluster's members, comma-separated: "http://10.0.0.1:2379,http://10.0.0.2:2379" (a bare
     * "host:port" means http). Requests go to one member and move to the next when it does not
     * answer, so a cluster that keeps quorum is used through a member's loss. Required. */
    const char *endpoints;
    const char *prefix;      /* key prefix; NULL = "/smartgen/" */
    /* The lease everything this handle writes lives under: renewed every third of it while the
     * process lives; entries of a process that died vanish when it passes. Whole seconds (rounded
     * up), 1000..3600000 ms; 0 = 5000. */
    uint32_t lease_ttl_ms;
    /* One request to one member before the next is tried; 0 = 1000. */
    uint32_t request_timeout_ms;
} sg_directory_options_t;

/* Sets struct_size and the defaults. Since 0.4. */
SG_API void sg_directory_options_init(sg_directory_options_t *options);
SG_API void sg_directory_options_init_sized(sg_directory_options_t *options, size_t size); /* Since 0.5. */
#define sg_directory_options_init(options) sg_directory_options_init_sized((options), sizeof *(options))

/* A handle on the directory for `ctx` (NULL: lookups and lists only); destroying ctx destroys it
 * too (sg_context_destroy). Checks that a member answers before it returns, within twice
 * request_timeout_ms however many members are listed. SG_OK; SG_ERR_INVALID_ARGUMENT (the
 * message names the bad option; a malformed endpoint: a scheme other than http/https, an unclosed
 * [IPv6] host, a port outside 1..65535); SG_ERR_CONNECT (no member answered: each one's reason in
 * the message); SG_ERR_TIMEOUT; SG_ERR_UNSUPPORTED (a library built without the directory);
 * SG_ERR_INVALID_HANDLE. Since 0.4. */
SG_API sg_status_t sg_directory_open(sg_context_t ctx, const sg_directory_options_t *options, sg_directory_t *out,
                                     sg_error_info_t *err);

/* Publishes the context's metadata under `name` (1-200 bytes of letters, digits, '.', '_', '-' and
 * '/' between parts) and answers session requests to it from then on (sg_directory_accept). A name
 * held by another handle is taken over only if that entry verifies under this context's key (the
 * same fleet: a restarted engine takes its name back at once); an entry of another key (or none)
 * stays, and the call fails with SG_ERR_AUTH_FAILED until that engine unpublishes it or its lease
 * ends. The handle reads its names back every third of the lease TTL: a name found gone is written
 * again, one found taken over is counted (sg_directory_stats_t.names_taken_over) and written again
 * once it is free, so a name is never lost while its handle lives.
 * SG_OK; SG_ERR_INVALID_ARGUMENT; SG_ERR_INVALID_STATE (a handle without a context);
 * SG_ERR_AUTH_FAILED (above); SG_ERR_CONNECT / SG_ERR_TIMEOUT / SG_ERR_REMOTE (the cluster, with its
 * reason). Since 0.4. */
SG_API sg_status_t sg_directory_publish(sg_directory_t dir, const char *name, uint64_t timeout_ns);

/* Removes a name this handle published (an entry another handle has taken over stays).
 * SG_ERR_NOT_FOUND when it did not publish it. Since 0.4. */
SG_API sg_status_t sg_directory_unpublish(sg_directory_t dir, const char *name, uint64_t timeout_ns);

/* The metadata blob published under `name`. Caller buffer (see Conventions). SG_OK;
 * SG_ERR_NOT_FOUND (nobody has published it, or its lease ended); SG_ERR_BUFFER_TOO_SMALL;
 * SG_ERR_CONNECT / SG_ERR_TIMEOUT (the directory is out of reach: sessions already open are not
 * affected); SG_ERR_INVALID_ARGUMENT. Since 0.4. */
SG_API sg_status_t sg_directory_lookup(sg_directory_t dir, const char *name, uint64_t timeout_ns, void *buf,
                                       size_t cap, size_t *len);

/* The names published under `name_prefix` (NULL or "" for all), sorted, each followed by a NUL,
 * back to back; *count gets how many. Caller buffer (see Conventions): *len is the bytes needed.
 * Since 0.4. */
SG_API sg_status_t sg_directory_list(sg_directory_t dir, const char *name_prefix, uint64_t timeout_ns, char *buf,
                                     size_t cap, size_t *len, size_t *count);

/* Waits until `name` is published (present != 0) or gone (present == 0), watching the cluster.
 * SG_OK; SG_ERR_TIMEOUT; SG_ERR_CONNECT. Since 0.4. */
SG_API sg_status_t sg_directory_wait(sg_directory_t dir, const char *name, int present, uint64_t timeout_ns);

/* Opens a session to the engine published as `name`, in one call: looks its blob up, leaves this
 * context's blob in its inbox (under this handle's lease) and makes the session from the peer's
 * blob, which the peer's directory handle answers at once (it need not be in sg_directory_accept).
 * The session is then as one from sg_session_from_metadata: sg_session_wait_ready waits for the
 * key's challenge-response. Statuses as sg_directory_lookup and sg_session_from_metadata
 * (SG_ERR_AUTH_FAILED: an entry not signed with this context's key). Since 0.4. */
SG_API sg_status_t sg_directory_connect(sg_directory_t dir, const char *name, const sg_session_options_t *options,
                                        uint64_t timeout_ns, sg_session_t *out, sg_error_info_t *err);

/* The next session a peer opened to this handle's published name (sg_directory_connect). The
 * handle made it when the request arrived (default session options: the provider chosen
 * automatically) and keeps it until it is taken here. SG_OK; SG_ERR_TIMEOUT; SG_ERR_INVALID_STATE
 * (nothing published). A request whose blob is not signed with the context's key makes no session
 * and is dropped (counted in sg_directory_stats). Since 0.4. */
SG_API sg_status_t sg_directory_accept(sg_directory_t dir, uint64_t timeout_ns, sg_session_t *out,
                                       sg_error_info_t *err);

typedef struct sg_directory_stats {
    size_t struct_size;          /* set by sg_directory_stats_init */
    uint64_t requests;           /* HTTP requests to the cluster */
    uint64_t failovers;          /* requests that moved to another member */
    uint64_t keepalives;         /* lease renewals answered */
    uint64_t leases_granted;     /* the first lease, and each one after a lease ended */
    uint64_t sessions_accepted;  /* sessions made from requests to the published name */
    uint64_t requests_refused;   /* requests whose blob did not verify (unsigned, another key, corrupt) */
    /* Since 0.5: the handle reads its names back every third of the lease TTL. */
    uint64_t names_taken_over;   /* a published name found held by another handle (same key) */
    uint64_t names_restored;     /* a published name found gone or free again, and written back */
} sg_directory_stats_t;

/* Sets struct_size and clears the rest. Since 0.4. */
SG_API void sg_directory_stats_init(sg_directory_stats_t *stats);
SG_API void sg_directory_stats_init_sized(sg_directory_stats_t *stats, size_t size); /* Since 0.5. */
#define sg_directory_stats_init(stats) sg_directory_stats_init_sized((stats), sizeof *(stats))
SG_API sg_status_t sg_directory_stats(sg_directory_t dir, sg_directory_stats_t *stats);

/* Revokes the handle's lease (its names and requests vanish at once) and frees it; sessions made
 * through it stay open. NULL accepted. Since 0.4. */
SG_API sg_status_t sg_directory_destroy(sg_directory_t dir);

/* ---------------------------------------------------------------------------------------------
 * Profiles and selectors
 * ------------------------------------------------------------------------------------------- */
/* A selection profile: per layer and KV head, a policy (sinks_recent, quest, snapkv, h2o, dense)
 * and a budget; JSON, format in docs/profiles.md. Immutable once made; thread-safe to share. */
typedef struct sg_profile_s *sg_profile_t;

/* Largest profile, in bytes, that sg_profile_parse and sg_profile_load accept (64 MiB). */
#define SG_PROFILE_MAX_BYTES (64u * 1024u * 1024u)

/* Parses a profile from JSON text (len bytes; only whitespace may follow the JSON value within len,
 * so a NUL byte is refused). SG_ERR_INVALID_ARGUMENT with a message naming the bad field
 * ("layers[3].heads[1].budget: ..."), also for malformed JSON, a number no double holds, a field
 * given twice, len > SG_PROFILE_MAX_BYTES, or a shape beyond the limits of docs/profiles.md
 * (num_layers, num_kv_heads <= 65536, their product <= 2^20): parsing takes time linear in len;
 * SG_ERR_VERSION_MISMATCH for another profile version; SG_ERR_NO_MEMORY. Since 0.1. */
SG_API sg_status_t sg_profile_parse(const char *json, size_t len, sg_profile_t *out, sg_error_info_t *err);
/* Reads and parses a profile file, as sg_profile_parse. SG_ERR_NOT_FOUND when it cannot be opened
 * or read; SG_ERR_INVALID_ARGUMENT when it is not a regular file (a device, FIFO or directory) or
 * is larger than SG_PROFILE_MAX_BYTES. Since 0.1. */
SG_API sg_status_t sg_profile_load(const char *path, sg_profile_t *out, sg_error_info_t *err);
/* The profile as JSON (canonical form), NUL-terminated, into buf. Caller buffer (see Conventions):
 * *len receives the text's bytes without the NUL, so buf needs cap > *len. Since 0.1. */
SG_API sg_status_t sg_profile_to_json(sg_profile_t profile, char *buf, size_t cap, size_t *len);
/* NULL accepted. A profile may be destroyed while transfers made with it run (they hold a copy).
 * Since 0.1. */
SG_API sg_status_t sg_profile_destroy(sg_profile_t profile);

/* A selector applies a profile to one request (its token count and KV shape), without any
 * transfer: the decode side uses it for its own per-step selection. Not thread-safe per object. */
typedef struct sg_selector_s *sg_selector_t;

/* layout gives the KV shape (num_layers, num_kv_heads, head_dim, tokens_per_block, dtype); its base
 * pointers are not used here. The profile's shape must match. Returns SG_OK with *out;
 * SG_ERR_INVALID_ARGUMENT (num_tokens 0, out or layout NULL); SG_ERR_OUT_OF_RANGE (num_tokens more
 * than a selector holds: over 2^32 - 1 blocks, or one layer's digests beyond size_t);
 * SG_ERR_INVALID_LAYOUT; SG_ERR_LAYOUT_MISMATCH (the profile's shape differs);
 * SG_ERR_INVALID_HANDLE; SG_ERR_NO_MEMORY. Since 0.1. */
SG_API sg_status_t sg_selector_create(sg_profile_t profile, const sg_kv_layout_t *layout, uint64_t num_tokens,
                                      sg_selector_t *out, sg_error_info_t *err);
SG_API sg_status_t sg_selector_destroy(sg_selector_t selector);

/* Floats of one layer's digests: num_blocks * num_kv_heads * 2 * head_dim. Since 0.1. */
SG_API sg_status_t sg_selector_digest_floats(sg_selector_t selector, size_t *floats);

/* Page digests of one layer (Quest), read from a pool through the request's block table:
 * out[block][kv_head][0][i] = min over the block's tokens of key element i, [1][i] = max. Keys are
 * expected to be finite: for a key element that is NaN the digest's value is unspecified (the
 * vector and scalar paths order NaN differently), so two sides may disagree on it. layout's
 * base pointers and block_ids (num_blocks entries) address the keys; the table is checked as
 * sg_transfer_expect checks it, against the selector's num_tokens. out holds cap floats; there is
 * no size out-parameter (see Caller buffers): sg_selector_digest_floats gives the count, out NULL
 * is SG_ERR_INVALID_ARGUMENT and fewer floats SG_ERR_BUFFER_TOO_SMALL. An SG_MEM_CUDA layout's keys
 * (here and for SnapKV in sg_selector_select) are read through the CUDA plugin into a host copy
 * (since 0.3; SG_ERR_UNSUPPORTED naming what is missing without the plugin, a driver or the
 * device). Since 0.1. */
SG_API sg_status_t sg_selector_digest(sg_selector_t selector, const sg_kv_layout_t *layout, uint32_t layer,
                                      const uint32_t *block_ids, size_t num_block_ids, float *out, size_t cap);

typedef struct sg_selector_input {
    size_t struct_size; /* set by sg_selector_input_init */
    /* Queries, fp32 [num_queries][num_q_heads][head_dim], after RoPE: the last prompt positions
     * (SnapKV uses all of them, Quest the last) or, at decode, the current step's query. */
    const float *queries;
    uint32_t num_queries;
    uint32_t num_q_heads; /* a multiple of num_kv_heads (grouped-query attention) */
    /* Quest: the layer's digests (sg_selector_digest or sg_transfer_digests). */
    const float *digests;
    /* SnapKV: the keys, through a layout and the request's block table (checked as sg_selector_digest
     * checks it). */
    const sg_kv_layout_t *keys_layout;
    const uint32_t *block_ids;
    size_t num_block_ids;
    /* H2O: accumulated attention per KV head and token, fp32 [num_kv_heads][num_tokens]. */
    const float *accumulated;
} sg_selector_input_t;

SG_API void sg_selector_input_init(sg_selector_input_t *input);
SG_API void sg_selector_input_init_sized(sg_selector_input_t *input, size_t size); /* Since 0.5. */
#define sg_selector_input_init(input) sg_selector_input_init_sized((input), sizeof *(input))

/* Selects the essential blocks of one layer under its budget: sinks and recent window always, the
 * rest by the layer's policy, per KV head; the union over heads, sorted, as logical block indices
 * (positions in the request's block table) into blocks (cap entries), the count into *count
 * (caller buffer, see Conventions: blocks NULL with cap 0 asks for the count). A dense layer
 * selects every block. Returns SG_OK, SG_ERR_BUFFER_TOO_SMALL (with *count set),
 * SG_ERR_INVALID_ARGUMENT (an input the policy needs is missing). Since 0.1. */
SG_API sg_status_t sg_selector_select(sg_selector_t selector, uint32_t layer, const sg_selector_input_t *input,
                                      uint32_t *blocks, size_t cap, size_t *count);

/* The layer's budget in blocks (per KV head, sinks and recent included, rounded up). Since 0.1. */
SG_API sg_status_t sg_selector_budget_blocks(sg_selector_t selector, uint32_t layer, uint64_t *blocks);

/* ---------------------------------------------------------------------------------------------
 * Attention parts (parallel on-demand attention)
 * ------------------------------------------------------------------------------------------- */
/* A decode step need not wait for the blocks it fetched: it attends to the keys it holds while the
 * rest are in flight, then to the arrived ones, and merges the two parts. A part over a set of keys
 * S, for one query row (one query head) with scaled scores s_j = q.k_j / sqrt(head_dim), is
 *   max = max_j s_j,   sum = sum_j exp(s_j - max),   acc[i] = sum_j exp(s_j - max) * v_j[i]
 * (head_dim floats); attention over S is acc / sum. Parts over disjoint sets merge into the part of
 * their union exactly up to float rounding (the log-sum-exp merge), in any order and any split.
 * An empty part is max = -INFINITY, sum = 0, acc = zeros; any row with sum 0 counts as empty, and
 * merging an empty row changes nothing. Arrays are row-major: max[rows], sum[rows],
 * acc[rows][head_dim], rows being the query heads of one layer (or any number of query rows).
 * No context is needed; the calls touch only the caller's arrays and are thread-safe. */

/* Merges part b (max_b, sum_b, acc_b) into part a (max, sum, acc, in/out) row by row. b may be a
 * itself (the rows then count twice). Every row of both parts must be a part: sum finite and >= 0,
 * and max finite where sum > 0; otherwise, as for a NULL array or rows or head_dim 0,
 * SG_ERR_INVALID_ARGUMENT naming the row, with a left untouched. Two valid rows whose sums (or
 * accumulators) would add past float range are merged in double and rescaled: sum and acc divided
 * by 2^k and k ln 2 added to max, the same part (never an infinite sum). Returns SG_OK or
 * SG_ERR_INVALID_ARGUMENT. Since 0.2. */
SG_API sg_status_t sg_attention_merge(uint32_t rows, uint32_t head_dim, float *max, float *sum, float *acc,
                                      const float *max_b, const float *sum_b, const float *acc_b);

/* The attention output of each row: out[r][i] = acc[r][i] / sum[r]; a row with sum 0 (empty) gives
 * zeros. out (rows * head_dim floats) may be acc itself. SG_ERR_INVALID_ARGUMENT for a NULL array,
 * rows or head_dim 0, or a sum that is negative, infinite or NaN; SG_ERR_OUT_OF_RANGE for an
 * acc[r][i] / sum[r] beyond float range or NaN (a tiny sum under a large acc is not a part: never
 * an infinite output); out untouched on either. Since 0.2. */
SG_API sg_status_t sg_attention_finish(uint32_t rows, uint32_t head_dim, const float *sum, const float *acc,
                                       float *out);

/* ---------------------------------------------------------------------------------------------
 * Transfers
 * ------------------------------------------------------------------------------------------- */
/* Paths a transfer uses (post side; the decode side follows). Bits; values pinned.
 * SG_PATH_FULL: every block, layer by layer as layers are written.
 * SG_PATH_PROACTIVE: as each layer is written, its essential blocks (chosen with the transfer's
 *   profile: sinks, recent window, top-scored blocks; dense layers and heads whole) and the layer's
 *   page digests (per block and KV head, element-wise min and max of the keys) go at once.
 * SG_PATH_ON_DEMAND: the decode side may fetch blocks it lacks (sg_transfer_fetch); they are served
 *   before any other traffic of the context.
 * SG_PATH_SPECULATIVE: whatever has not been sent goes in the background at the lowest priority,
 *   in small chunks, until the decode side holds everything.
 * FULL excludes the others (SG_ERR_INVALID_ARGUMENT); the selective paths need the same
 * tokens_per_block on both sides (else the transfer fails with SG_ERR_LAYOUT_MISMATCH at the match).
 * Every block moves at most once, under the first path that claims it. Without SG_PATH_SPECULATIVE
 * a selective transfer never completes on its own: the decode side ends it with
 * sg_transfer_release (not a cancel on either side: both count it completed), or the lease ends it.
 * The decode side learns the paths when the prefill side matches the request. */
#define SG_PATH_FULL 0x1u
#define SG_PATH_PROACTIVE 0x2u
#define SG_PATH_ON_DEMAND 0x4u
#define SG_PATH_SPECULATIVE 0x8u

/* Flags of sg_transfer_options_t; unknown bits are refused (SG_ERR_INVALID_ARGUMENT). */
#define SG_TRANSFER_ALL_LAYERS_WRITTEN 0x1u /* post: every layer is already written; send at once */

/* Readiness bits of one layer (sg_transfer_layer_state). */
#define SG_LAYER_WRITTEN 0x1u /* prefill side: the engine marked the layer written */
#define SG_LAYER_READY 0x2u   /* prefill: all its bytes delivered; decode: all its bytes in place */
#define SG_LAYER_ESSENTIAL 0x4u /* proactive path: the layer's essential blocks and digests delivered
                                   (prefill) or in place (decode) */

#define SG_REQUEST_ID_MAX 255 /* bytes of a request id, without the NUL */

/* In-flight quantization (sg_transfer_options_t.wire_quant): KV travels as one-byte codes with a
 * float scale per (block, K or V plane, KV head): scale = max |x| / 127 (int8, codes -127..127) or
 * / 448 (FP8 E4M3, OCP "FN", saturating), each element the nearest code (ties to even); the decode
 * side multiplies back into its pool's dtype. The maximum is over finite elements: a non-finite
 * element (±Inf, NaN) arrives as NaN, for both codes, and the rest of its head arrive as they would
 * without it (since 0.5; 0.4's int8 sent the whole head back non-finite). Lossy: both sides must
 * name the same value (the expect consents), else the transfer fails with SG_ERR_LAYOUT_MISMATCH
 * at the match. Pools of fp32, fp16 or bf16 only. Values pinned; since 0.3. */
typedef uint32_t sg_wire_quant_t;
enum sg_wire_quant {
    SG_WIRE_QUANT_NONE = 0,
    SG_WIRE_QUANT_INT8 = 1,
    SG_WIRE_QUANT_FP8_E4M3 = 2
};

typedef struct sg_transfer_options {
    size_t struct_size;
    uint32_t paths;    /* SG_PATH_* bits; 0 means SG_PATH_FULL. Unknown bits are refused
                          (SG_ERR_INVALID_ARGUMENT), on both sides. */
    uint32_t flags;    /* SG_TRANSFER_* bits. Unknown bits are refused (SG_ERR_INVALID_ARGUMENT),
                          on both sides. */
    int32_t priority;  /* higher first among this context's transfers; default 0 */
    /* Order in which layers are sent (post side): NULL = 0..num_layers-1; else a permutation of it,
     * layer_order_count = num_layers. Borrowed for the call. */
    const uint32_t *layer_order;
    size_t layer_order_count;
    /* Nanoseconds from the expect/post call by which the transfer must complete; 0 = none. When it
     * passes, the transfer fails with SG_ERR_DEADLINE on this side and the peer is told. */
    uint64_t deadline_ns;
    /* Post side with SG_PATH_PROACTIVE: the profile that decides each layer's essential blocks
     * (copied at the call). NULL: sinks and recent window only, 1/8 of the blocks. */
    sg_profile_t profile;
    /* Post side, selective paths: how long after the last layer is written the prefill side keeps
     * the request's blocks for on-demand and speculative traffic. When it passes before the decode
     * side holds everything, the owner gets SG_EVENT_LEASE_EXPIRED and the transfer ends with
     * SG_ERR_LEASE_EXPIRED on both sides. 0 = until the decode side releases the transfer. */
    uint64_t lease_ns;
    /* SG_WIRE_QUANT_*: how the KV travels; 0 (SG_WIRE_QUANT_NONE) = as the pools hold it. Both
     * sides must give the same value. Every block then goes through the staging path (packed,
     * quantized on the prefill side's progress thread, dequantized on the decode side's before the
     * block counts as resident); a piece that cannot be quantized (padding inside a coalesced
     * range) goes as it is. Other values, or a pool of another dtype, are refused
     * (SG_ERR_INVALID_ARGUMENT). The wire must be a 0.3 peer's: a 0.2 prefill side ignores the
     * field and sends unquantized bytes, which the decode side takes as they are. Since 0.3; a
     * library before 0.3 ignores the field (struct_size). */
    sg_wire_quant_t wire_quant;
} sg_transfer_options_t;

/* Fills struct_size and defaults. Since 0.1. */
SG_API void sg_transfer_options_init(sg_transfer_options_t *options);
SG_API void sg_transfer_options_init_sized(sg_transfer_options_t *options, size_t size); /* Since 0.5. */
#define sg_transfer_options_init(options) sg_transfer_options_init_sized((options), sizeof *(options))

/* Decode side: expect the KV of request_id (NUL-terminated, at most SG_REQUEST_ID_MAX bytes) from the
 * session's peer into dst, at the blocks block_ids[0..num_blocks) covering num_tokens tokens (the
 * table is copied). Token t lives in block block_ids[t / tokens_per_block]; slots of the last block
 * past num_tokens are neither written nor read. The table holds exactly ceil(num_tokens /
 * tokens_per_block) entries, each a different block. dst must have been exported to the session.
 * Either side may come first.
 * Returns SG_OK with *out; SG_ERR_INVALID_ARGUMENT (num_tokens 0; more blocks than num_tokens needs,
 * the message says how many; a block id given twice; unknown bits in options->flags or
 * options->paths, the message names the field); SG_ERR_OUT_OF_RANGE (num_tokens more than the
 * pool holds, num_blocks x tokens_per_block; a block id >= the pool's num_blocks; too few blocks
 * for num_tokens); the table is checked before any byte moves. SG_ERR_DUPLICATE (request id
 * already expected on this session); SG_ERR_INVALID_STATE (dst not exported to the session);
 * SG_ERR_INVALID_HANDLE. Layout mismatches with the source are reported on the transfer
 * (SG_ERR_LAYOUT_MISMATCH from sg_transfer_test/wait) once the post side is known.
 * SG_ERR_AGAIN when the session already has max_transfers_per_session unfinished transfers: finish
 * or release some, then retry. Since 0.1. */
SG_API sg_status_t sg_transfer_expect(sg_session_t session, const char *request_id, sg_kv_handle_t dst,
                                      const uint32_t *block_ids, size_t num_blocks, uint64_t num_tokens,
                                      const sg_transfer_options_t *options, sg_transfer_t *out,
                                      sg_error_info_t *err);

/* Prefill side: post the KV of request_id from src at block_ids[0..num_blocks) (num_tokens tokens).
 * src must have been exported to the session too (that is its registration for the session).
 * Layers move as the engine marks them written (sg_transfer_layer_written), or all at once with
 * SG_TRANSFER_ALL_LAYERS_WRITTEN. Statuses as sg_transfer_expect; SG_ERR_LAYOUT_MISMATCH when the
 * expect is already known and the layouts cannot be mapped (different layer count, KV heads, head
 * dim or dtype; different block ids and tokens-per-block are mapped). Since 0.1. */
SG_API sg_status_t sg_transfer_post(sg_session_t session, const char *request_id, sg_kv_handle_t src,
                                    const uint32_t *block_ids, size_t num_blocks, uint64_t num_tokens,
                                    const sg_transfer_options_t *options, sg_transfer_t *out,
                                    sg_error_info_t *err);

/* Prefill side: the engine has finished writing layer `layer` of the request; the runtime may send
 * it. cuda_stream (a cudaStream_t, SG_MEM_CUDA pools only; since 0.3): the engine's kernels that
 * write the layer are queued on it and may still run. The call returns at once; the runtime records
 * an event on the stream and reads the layer only once that event has completed (it never waits on
 * the stream itself or queues work on it). NULL: the layer is written already. Returns SG_OK (also
 * when already marked), SG_ERR_OUT_OF_RANGE, SG_ERR_INVALID_STATE (decode-side transfer),
 * SG_ERR_INVALID_ARGUMENT (a stream with a host pool, or one the driver refuses),
 * SG_ERR_INVALID_HANDLE. Since 0.1. */
SG_API sg_status_t sg_transfer_layer_written(sg_transfer_t xfer, uint32_t layer, void *cuda_stream);

/* As sg_transfer_layer_written, with the layer's last prompt queries for query-aware selection on
 * the proactive path: fp32 [num_queries][num_q_heads][head_dim], after RoPE (copied at the call).
 * With SG_PATH_PROACTIVE the layer's digests and essential set are computed on a worker thread of
 * the context, so the engine goes on with its next layer at once; the layer's keys must stay as
 * they are until the transfer is released (they are read later). SG_ERR_INVALID_ARGUMENT when the
 * profile's policy for the layer needs queries (quest, snapkv) and none are given, or needs
 * accumulated attention (h2o, which the proactive path cannot take: use it through a selector).
 * Since 0.1. */
SG_API sg_status_t sg_transfer_layer_written_q(sg_transfer_t xfer, uint32_t layer, const float *queries,
                                               uint32_t num_queries, uint32_t num_q_heads);

/* The layer-written call with everything a device engine has at hand, in one struct that only grows
 * (struct_size): the queries (host memory, copied at the call, as sg_transfer_layer_written_q; or
 * device memory of the pool's device, read once the stream has passed the layer, so they must stay
 * unchanged until the layer's SG_LAYER_WRITTEN bit is set) and the engine's stream (as
 * sg_transfer_layer_written). A zeroed struct with struct_size is sg_transfer_layer_written(x, l,
 * NULL). Since 0.3. */
typedef struct sg_layer_written {
    size_t struct_size;         /* set by sg_layer_written_init */
    const float *queries;       /* fp32 [num_queries][num_q_heads][head_dim] after RoPE; NULL: none */
    uint32_t num_queries;
    uint32_t num_q_heads;
    sg_mem_kind_t queries_mem_kind; /* SG_MEM_HOST (0) or SG_MEM_CUDA (the pool's device, with a stream) */
    uint32_t reserved;          /* 0 */
    void *cuda_stream;          /* a cudaStream_t whose kernels write the layer (and the queries), or NULL */
} sg_layer_written_t;

/* Sets struct_size and clears the rest. Since 0.3. */
SG_API void sg_layer_written_init(sg_layer_written_t *args);
SG_API void sg_layer_written_init_sized(sg_layer_written_t *args, size_t size); /* Since 0.5. */
#define sg_layer_written_init(args) sg_layer_written_init_sized((args), sizeof *(args))

/* Returns as sg_transfer_layer_written_q, and SG_ERR_INVALID_ARGUMENT for args NULL or without
 * struct_size, reserved not 0, an unknown queries_mem_kind, device queries without a stream or with
 * a host pool. Since 0.3. */
SG_API sg_status_t sg_transfer_layer_written_ex(sg_transfer_t xfer, uint32_t layer, const sg_layer_written_t *args);

/* Waits until every bit of `bits` (SG_LAYER_*; unknown bits are refused, SG_ERR_INVALID_ARGUMENT)
 * is set for the layer: SG_OK, SG_ERR_TIMEOUT when timeout_ns passes first, or the transfer's error
 * (bits already set win over a later error). SG_ERR_INVALID_STATE for SG_LAYER_ESSENTIAL once the
 * transfer is known to run without SG_PATH_PROACTIVE. Since 0.1; SG_ERR_TIMEOUT (not
 * SG_IN_PROGRESS) on timeout since 0.2. */
SG_API sg_status_t sg_transfer_wait_layer_state(sg_transfer_t xfer, uint32_t layer, uint32_t bits,
                                                uint64_t timeout_ns);

/* Decode side, proactive path: the layer's page digests as received (fp32, the layout of
 * sg_selector_digest), into out (cap floats); *count receives the floats (caller buffer, see
 * Conventions). SG_ERR_INVALID_STATE before SG_LAYER_ESSENTIAL. Since 0.1. */
SG_API sg_status_t sg_transfer_digests(sg_transfer_t xfer, uint32_t layer, float *out, size_t cap, size_t *count);

/* Decode side, on-demand path: asks for logical blocks (positions in this side's block table) of a
 * layer that are not resident. Returns at once; residency bits (sg_transfer_residency) and
 * SG_EVENT_BLOCKS_READY tell when they are in place. They go before any other traffic of the prefill
 * side's context (a layer not written yet is served once it is). Blocks resident or already asked
 * for are not asked for again. SG_ERR_LEASE_EXPIRED when the prefill side no longer holds them;
 * SG_ERR_INVALID_STATE without SG_PATH_ON_DEMAND, or before the prefill side matched the request;
 * SG_ERR_OUT_OF_RANGE for a block beyond the request. Since 0.1. */
SG_API sg_status_t sg_transfer_fetch(sg_transfer_t xfer, uint32_t layer, const uint32_t *blocks, size_t count);

/* Decode side: waits until the given logical blocks of a layer are resident. SG_OK, SG_ERR_TIMEOUT
 * when timeout_ns passes first, SG_ERR_LEASE_EXPIRED when they can no longer come, or the
 * transfer's error. Since 0.1; SG_ERR_TIMEOUT (not SG_IN_PROGRESS) on timeout since 0.2. */
SG_API sg_status_t sg_transfer_wait_blocks(sg_transfer_t xfer, uint32_t layer, const uint32_t *blocks, size_t count,
                                           uint64_t timeout_ns);

/* Non-blocking completion check: SG_OK when every layer is ready (decode: every byte in place;
 * prefill: every operation completed and the decode side confirmed that every byte is in place,
 * so the source blocks may be reused and the prefill process may exit), SG_IN_PROGRESS otherwise,
 * or the transfer's error. Since 0.1; since 0.2 (wire protocol 1.1 on both sides) the prefill side
 * completes only on the decode side's confirmation. */
SG_API sg_status_t sg_transfer_test(sg_transfer_t xfer);

/* Waits up to timeout_ns for completion: SG_ERR_TIMEOUT when the timeout passes first (the transfer
 * goes on); otherwise as sg_transfer_test. Since 0.1; SG_ERR_TIMEOUT (not SG_IN_PROGRESS) on
 * timeout since 0.2. Since 0.5, between two 0.5 contexts, bytes that went through a staging slot
 * are checked (CRC32C): a chunk whose bytes changed on the way fails the transfer on both sides
 * with SG_ERR_TRANSPORT, and its blocks must not be used. */
SG_API sg_status_t sg_transfer_wait(sg_transfer_t xfer, uint64_t timeout_ns);

/* Waits up to timeout_ns for one layer to be ready: SG_OK, SG_ERR_TIMEOUT when the timeout passes
 * first, the transfer's error, or SG_ERR_OUT_OF_RANGE. On the decode side, SG_OK means every byte
 * of the layer is in place (the "layer ready" notice never overtakes its data on any provider).
 * Since 0.1; SG_ERR_TIMEOUT (not SG_IN_PROGRESS) on timeout since 0.2. */
SG_API sg_status_t sg_transfer_wait_layer(sg_transfer_t xfer, uint32_t layer, uint64_t timeout_ns);

/* Current SG_LAYER_* bits of one layer. Since 0.1. */
SG_API sg_status_t sg_transfer_layer_state(sg_transfer_t xfer, uint32_t layer, uint32_t *state);

/* Residency of one layer on the decode side: bit i (LSB first within each byte) set when the bytes of
 * this side's block_ids[i] are in place. bitmap has cap bytes; *num_bits receives num_blocks
 * (caller buffer, see Conventions; the size is in bits: the bitmap needs ceil(*num_bits / 8)
 * bytes, else SG_ERR_BUFFER_TOO_SMALL). On the prefill side the bitmap tells which blocks were
 * delivered. Since 0.1. */
SG_API sg_status_t sg_transfer_residency(sg_transfer_t xfer, uint32_t layer, uint8_t *bitmap, size_t cap,
                                         size_t *num_bits);

/* The transfer's status (as sg_transfer_test) and, into msg (optional, cap bytes), its error detail,
 * for errors that happened in the background: cut to fit and NUL-terminated (NULL with cap 0
 * skips it; NULL with cap > 0 is SG_ERR_INVALID_ARGUMENT). Since 0.1. */
SG_API sg_status_t sg_transfer_status(sg_transfer_t xfer, sg_status_t *status, char *msg, size_t cap);

typedef struct sg_transfer_stats {
    size_t struct_size;     /* set by sg_transfer_stats_init */
    uint64_t bytes;         /* bytes moved (or received, decode side): KV payload and page digests
                               (digests counted since 0.2) */
    uint64_t rma_ops;       /* RMA operations posted (prefill side) */
    uint64_t segments;      /* contiguous (src, dst) segments before coalescing */
    uint64_t staged_bytes;  /* bytes that went through the staging path */
    uint64_t staging_copies; /* memcpy calls made by staging pack + unpack on this side */
    uint64_t layers_ready;  /* layers in SG_LAYER_READY */
    uint64_t start_ns;      /* CLOCK_MONOTONIC when matched */
    uint64_t end_ns;        /* CLOCK_MONOTONIC when complete; 0 while in progress */
    /* Payload bytes by path (sent, or received on the decode side). */
    uint64_t bytes_full;
    uint64_t bytes_proactive;
    uint64_t bytes_on_demand;
    uint64_t bytes_speculative;
    uint64_t digest_bytes;      /* page digests sent or received (part of bytes); since 0.2 only those
                                   of blocks outside the layer's proactive set: the decode side digests
                                   the blocks it received itself */
    uint64_t fetch_requests;    /* on-demand requests (decode: made; prefill: served) */
    uint64_t fetch_blocks;      /* blocks those requests named that were not yet resident or sent */
    /* In-flight quantization (since 0.3): pool bytes that travelled quantized (part of bytes), and
     * the bytes their codes and scales took on the wire. */
    uint64_t quantized_bytes;
    uint64_t quantized_wire_bytes;
} sg_transfer_stats_t;

/* Sets struct_size and clears the rest. Since 0.1. */
SG_API void sg_transfer_stats_init(sg_transfer_stats_t *stats);
SG_API void sg_transfer_stats_init_sized(sg_transfer_stats_t *stats, size_t size); /* Since 0.5. */
#define sg_transfer_stats_init(stats) sg_transfer_stats_init_sized((stats), sizeof *(stats))

/* Statistics of a transfer, into *out (initialised with sg_transfer_stats_init). Since 0.1. */
SG_API sg_status_t sg_transfer_stats(sg_transfer_t xfer, sg_transfer_stats_t *out);

/* Nanoseconds until the layer became ready, counted from the later of the transfer's start and the
 * layer being marked written (prefill: start = the match with the expect; decode: start = the
 * expect call, and layers count as written at once); 0 while not ready. Since 0.1. */
SG_API sg_status_t sg_transfer_layer_time(sg_transfer_t xfer, uint32_t layer, uint64_t *ns);

/* Cancels the transfer on this side and tells the peer, whose transfer of the same request fails
 * with SG_ERR_CANCELED too (also when the peer expects or posts the request id only later); its
 * status becomes SG_ERR_CANCELED unless it had already completed. Returns at once: the blocks may be
 * reused only once the transfer is quiesced (sg_transfer_wait_quiesced). Since 0.1. */
SG_API sg_status_t sg_transfer_cancel(sg_transfer_t xfer);

/* Waits until the transfer is quiesced: it has finished (completed, failed, canceled, missed its
 * deadline or lost its peer), no operation of it is in flight on this side, and — decode side — the
 * peer can no longer write into its blocks (the peer confirmed that its writes stopped, or the
 * session ended and was fenced: its connections closed, then its memory registrations). From then
 * on the transfer's blocks may be reused, and nothing of the transfer is written into or read from
 * them again, even when a link that was down longer than the peer timeout comes back (over shm,
 * which has no connection to close, the registrations close once this side's writes completed). Returns SG_OK; SG_ERR_TIMEOUT (still running, or the confirmation has not come);
 * SG_ERR_INVALID_HANDLE. Thread-safe. Since 0.1. */
SG_API sg_status_t sg_transfer_wait_quiesced(sg_transfer_t xfer, uint64_t timeout_ns);

/* Releases a transfer handle. An incomplete transfer is canceled first; release then waits until
 * the transfer is quiesced (see sg_transfer_wait_quiesced). A peer that stays silent is lost after
 * peer_timeout_ms; one that answers but never confirms is, after twice that, treated as broken and
 * its session fails with SG_ERR_PROTOCOL (its registrations closed), so release always returns.
 * NULL accepted. Since 0.1. */
SG_API sg_status_t sg_transfer_release(sg_transfer_t xfer);

#ifdef __cplusplus
}
#endif

#endif /* SMARTGEN_SMARTGEN_H */
