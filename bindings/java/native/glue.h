/* JNI glue of the Java binding: what the SWIG-generated wrapper (bindings/swig/java.i) cannot do
 * with typemaps alone. Everything here is called from inside a JNI call of the raw layer, or (the
 * event trampoline) from a library thread. */
#ifndef SMARTGEN_JAVA_GLUE_H
#define SMARTGEN_JAVA_GLUE_H

#include <jni.h>
#include <smartgen/smartgen.h>

/* Throws io.smartgen.SmartGenException(status, message) as the pending exception of env. */
void sgj_throw(JNIEnv *env, sg_status_t status, const char *message);

/* An out-parameter array must hold at least one element; else throws and returns 0. */
int sgj_check_out(JNIEnv *env, jlongArray out);

/* A malloc'd copy of an int[] as uint32_t (NULL for a null or empty array, or, with an exception
 * pending, when memory ran out). Freed by the caller. */
uint32_t *sgj_copy_ints(JNIEnv *env, jintArray array);

/* sg_context_create with the pointer options the raw proxy leaves out. dispatcher (an
 * io.smartgen.internal.EventDispatcher, or null) receives the context's transfer events; *sink_out
 * receives what sgj_context_destroy must free once the context is gone (0 without a dispatcher). */
sg_status_t sgj_context_create(JNIEnv *env, const sg_context_options_t *options, const char *provider,
                               const char *local_addr, jbyteArray auth_key, jobject dispatcher,
                               sg_context_t *out, long long *sink_out);

/* sg_context_destroy, then the event sink (no callback can run after the context is destroyed). */
sg_status_t sgj_context_destroy(JNIEnv *env, sg_context_t ctx, long long sink);

/* Set up by JNI_OnLoad: the dispatcher's method, and the VM the trampoline attaches threads to. */
int sgj_events_init(JavaVM *vm, JNIEnv *env);

/* Called by the binding's shutdown hook: from then on no thread detaches or calls into Java. */
void sgj_vm_exiting(void);

/* The sg_event_fn given to the library: event_user is the dispatcher's global reference. */
void sgj_on_event(void *user, const sg_event_t *event);

/* sg_kv_register with the per-layer base addresses of direct ByteBuffers (v_buffers null: fused).
 * The library copies the pointer arrays; the buffers stay the caller's. */
sg_status_t sgj_kv_register(JNIEnv *env, sg_context_t ctx, const sg_kv_layout_t *layout,
                            jobjectArray k_buffers, jobjectArray v_buffers, sg_kv_handle_t *out);
/* sg_directory_open with its options as arguments (NULL / 0: the defaults). */
sg_status_t sgj_directory_open(sg_context_t ctx, const char *endpoints, const char *prefix, uint32_t lease_ttl_ms,
                               uint32_t request_timeout_ms, sg_directory_t *out);
/* sg_transfer_layer_written_ex with the struct's fields as arguments: host queries (copied by the
 * library during the call) or a device address, and the CUDA stream as an address. */
sg_status_t sgj_transfer_layer_written_ex(sg_transfer_t xfer, uint32_t layer, const float *queries,
                                          long long device_queries, uint32_t num_queries, uint32_t num_q_heads,
                                          uint32_t queries_mem_kind, long long cuda_stream);
/* The same over addresses the host owns (native or device memory): one per layer, v NULL when fused. */
sg_status_t sgj_kv_register_addresses(JNIEnv *env, sg_context_t ctx, const sg_kv_layout_t *layout,
                                      jlongArray k_addresses, jlongArray v_addresses, sg_kv_handle_t *out);

/* sg_transfer_layer_state with the bits as the return value (the hot query of a decode loop: no
 * out-array per call); a failure throws. */
long long sgj_transfer_layer_state(JNIEnv *env, sg_transfer_t xfer, uint32_t layer);

#endif
