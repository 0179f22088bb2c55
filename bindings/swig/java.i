/* The Java part of the SWIG interface (JNI, Java 17): the raw layer io.smartgen.internal, which only
 * the public package io.smartgen calls. Included by smartgen.i under SWIGJAVA; it reads the header
 * itself, at the end, so that the glue declared after it sees the header's types.
 *
 * Shapes chosen for the raw layer:
 *   - Handles are Java longs (the 64-bit handle value); a handle out-parameter is a long[1].
 *   - A failing sg_status_t throws io.smartgen.SmartGenException from C, inside the same JNI call
 *     as the failing function, with sg_last_error_message() read right after it (the library
 *     records every failure there, also for the calls that take an sg_error_info_t). The statuses a
 *     caller expects as answers rather than failures come back as values instead: SG_ERR_TIMEOUT
 *     from the waits, SG_ERR_AGAIN / SG_ERR_BUFFER_TOO_SMALL from sg_session_next_notification.
 *   - Scalar out-parameters are long[1]; caller buffers are Java arrays (null = NULL with cap 0).
 *   - What needs JNIEnv (direct ByteBuffer addresses, the event trampoline, the key bytes) is in
 *     bindings/java/native/glue.c, declared at the end of this file. */

%{
#include <jni.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "glue.h"
%}

%pragma(java) jniclasscode=%{
  static {
    NativeLoader.load();
  }
%}

/* Plain int constants instead of SWIG's typesafe-enum classes: the header's enums only name
 * constants, and an unknown value must stay a number (Conventions). */
%include "enumtypeunsafe.swg"
%javaconst(1);
/* Macros with an unsigned suffix (0x1u) are no Java literals: their values come through JNI. */
%javaconst(0) SG_PROGRESS_SPIN_NONE;
%javaconst(0) SG_PROFILE_MAX_BYTES;
%javaconst(0) SG_PATH_FULL;
%javaconst(0) SG_PATH_PROACTIVE;
%javaconst(0) SG_PATH_ON_DEMAND;
%javaconst(0) SG_PATH_SPECULATIVE;
%javaconst(0) SG_TRANSFER_ALL_LAYERS_WRITTEN;
%javaconst(0) SG_LAYER_WRITTEN;
%javaconst(0) SG_LAYER_READY;
%javaconst(0) SG_LAYER_ESSENTIAL;

/* Proxies are freed explicitly (delete() in a finally block): finalizers are deprecated in Java 17
 * and would free at a time nobody chose. */
%typemap(javafinalize) SWIGTYPE ""

/* 64-bit unsigned values (sizes, nanoseconds, counters) as Java long, not BigInteger; 32-bit ones
 * (layers, bits, kinds) as int: no value the header defines needs the sign bit except
 * SG_PROGRESS_SPIN_NONE, which keeps its bit pattern. */
%apply long long { uint64_t };
%apply int { uint32_t };

/* ---- JNIEnv for the glue functions -------------------------------------------------------- */
%typemap(in, numinputs=0) JNIEnv *jenv_arg %{ $1 = jenv; %}

/* The error detail comes from sg_last_error_message (see above); the host-memory API has no stream. */
%typemap(in, numinputs=0) sg_error_info_t *err %{ $1 = NULL; %}
%typemap(in, numinputs=0) void *cuda_stream %{ $1 = NULL; %}

/* ---- statuses -------------------------------------------------------------------------------- */
/* No early return after a throw: the argout typemaps then write nothing (they check for the
 * pending exception) and the freearg typemaps still release the argument copies. */
%typemap(out) sg_status_t %{
  if ($1 < 0)
    sgj_throw(jenv, $1, sg_last_error_message());
  $result = (jint)$1;
%}

%define SGJ_SOFT_STATUS(FUNC, COND)
%typemap(out) sg_status_t FUNC %{
  if ($1 < 0 && !(COND))
    sgj_throw(jenv, $1, sg_last_error_message());
  $result = (jint)$1;
%}
%enddef

SGJ_SOFT_STATUS(sg_transfer_wait, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_transfer_wait_layer, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_transfer_wait_layer_state, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_transfer_wait_blocks, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_transfer_wait_quiesced, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_session_wait_ready, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_session_close, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_session_next_notification, $1 == SG_ERR_AGAIN || $1 == SG_ERR_BUFFER_TOO_SMALL)
SGJ_SOFT_STATUS(sg_directory_wait, $1 == SG_ERR_TIMEOUT)
SGJ_SOFT_STATUS(sg_directory_lookup, $1 == SG_ERR_BUFFER_TOO_SMALL || $1 == SG_ERR_NOT_FOUND)
SGJ_SOFT_STATUS(sg_directory_list, $1 == SG_ERR_BUFFER_TOO_SMALL)

/* ---- handles --------------------------------------------------------------------------------- */
%define SGJ_HANDLE(T)
%typemap(jni) T "jlong"
%typemap(jtype) T "long"
%typemap(jstype) T "long"
%typemap(javain) T "$javainput"
%typemap(javaout) T { return $jnicall; }
%typemap(in) T %{ $1 = (T)(uintptr_t)$input; %}
%typemap(out) T %{ $result = (jlong)(uintptr_t)$1; %}
%typemap(memberin) T %{ $1 = $input; %}

%typemap(jni) T *out "jlongArray"
%typemap(jtype) T *out "long[]"
%typemap(jstype) T *out "long[]"
%typemap(javain) T *out "$javainput"
%typemap(in) T *out ($*1_ltype temp = 0) %{
  if (!sgj_check_out(jenv, $input)) return $null;
  $1 = &temp;
%}
%typemap(argout) T *out %{
  if (!(*jenv)->ExceptionCheck(jenv)) {
    jlong v = (jlong)(uintptr_t)temp$argnum;
    (*jenv)->SetLongArrayRegion(jenv, $input, 0, 1, &v);
  }
%}
%enddef

SGJ_HANDLE(sg_context_t)
SGJ_HANDLE(sg_kv_handle_t)
SGJ_HANDLE(sg_listener_t)
SGJ_HANDLE(sg_session_t)
SGJ_HANDLE(sg_transfer_t)
SGJ_HANDLE(sg_directory_t)
SGJ_HANDLE(sg_profile_t)

/* ---- scalar out-parameters: long[1] -------------------------------------------------------- */
/* Written back also after SG_ERR_BUFFER_TOO_SMALL, which reports the size needed (Conventions);
 * otherwise only SG_OK writes them and the 0 they start from is what a failed call leaves. */
%define SGJ_OUT_SCALAR(PATTERN)
%typemap(jni) PATTERN "jlongArray"
%typemap(jtype) PATTERN "long[]"
%typemap(jstype) PATTERN "long[]"
%typemap(javain) PATTERN "$javainput"
%typemap(in) PATTERN ($*1_ltype temp = 0) %{
  if (!sgj_check_out(jenv, $input)) return $null;
  $1 = &temp;
%}
%typemap(argout) PATTERN %{
  if (!(*jenv)->ExceptionCheck(jenv)) {
    jlong v = (jlong)temp$argnum;
    (*jenv)->SetLongArrayRegion(jenv, $input, 0, 1, &v);
  }
%}
%enddef

SGJ_OUT_SCALAR(uint32_t *state)
SGJ_OUT_SCALAR(uint16_t *port)
SGJ_OUT_SCALAR(int *fd)
SGJ_OUT_SCALAR(size_t *len)
SGJ_OUT_SCALAR(size_t *num_bits)
SGJ_OUT_SCALAR(size_t *count)
SGJ_OUT_SCALAR(uint64_t *bytes)
SGJ_OUT_SCALAR(uint64_t *ns)
SGJ_OUT_SCALAR(uint64_t *value)
SGJ_OUT_SCALAR(uint64_t *min_value)
SGJ_OUT_SCALAR(uint64_t *max_value)
SGJ_OUT_SCALAR(sg_status_t *status)
SGJ_OUT_SCALAR(long long *sink_out)

/* ---- input arrays ------------------------------------------------------------------------------ */
%typemap(jni) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) "jintArray"
%typemap(jtype) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) "int[]"
%typemap(jstype) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) "int[]"
%typemap(javain) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) "$javainput"
%typemap(in) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) %{
  $2 = $input ? (size_t)(*jenv)->GetArrayLength(jenv, $input) : 0;
  $1 = (uint32_t *)sgj_copy_ints(jenv, $input);
  if ($input && !$1) return $null;
%}
%typemap(freearg) (const uint32_t *block_ids, size_t num_blocks), (const uint32_t *blocks, size_t count) %{
  free((void *)$1);
%}

%typemap(jni) (const void *data, size_t len), (const char *json, size_t len) "jbyteArray"
%typemap(jtype) (const void *data, size_t len), (const char *json, size_t len) "byte[]"
%typemap(jstype) (const void *data, size_t len), (const char *json, size_t len) "byte[]"
%typemap(javain) (const void *data, size_t len), (const char *json, size_t len) "$javainput"
%typemap(in) (const void *data, size_t len), (const char *json, size_t len) %{
  $2 = $input ? (size_t)(*jenv)->GetArrayLength(jenv, $input) : 0;
  $1 = $input ? ($1_ltype)(*jenv)->GetByteArrayElements(jenv, $input, NULL) : NULL;
  if ($input && !$1) return $null;
%}
%typemap(freearg) (const void *data, size_t len), (const char *json, size_t len) %{
  if ($1) (*jenv)->ReleaseByteArrayElements(jenv, $input, (jbyte *)$1, JNI_ABORT);
%}

%typemap(jni) const float *queries "jfloatArray"
%typemap(jtype) const float *queries "float[]"
%typemap(jstype) const float *queries "float[]"
%typemap(javain) const float *queries "$javainput"
%typemap(in) const float *queries %{
  $1 = $input ? (float *)(*jenv)->GetFloatArrayElements(jenv, $input, NULL) : NULL;
  if ($input && !$1) return $null;
%}
%typemap(freearg) const float *queries %{
  if ($1) (*jenv)->ReleaseFloatArrayElements(jenv, $input, (jfloat *)$1, JNI_ABORT);
%}

/* ---- caller buffers: Java arrays, copied back when the call succeeds -------------------------- */
%define SGJ_OUT_BUFFER(PTR, CAP, JNIARR, JARR, JELEM, GET, RELEASE)
%typemap(jni) (PTR, CAP) "JNIARR"
%typemap(jtype) (PTR, CAP) "JARR"
%typemap(jstype) (PTR, CAP) "JARR"
%typemap(javain) (PTR, CAP) "$javainput"
%typemap(in) (PTR, CAP) %{
  $2 = $input ? (size_t)(*jenv)->GetArrayLength(jenv, $input) : 0;
  $1 = $input ? ($1_ltype)(*jenv)->GET(jenv, $input, NULL) : NULL;
  if ($input && !$1) return $null;
%}
%typemap(freearg) (PTR, CAP) %{
  if ($1) (*jenv)->RELEASE(jenv, $input, (JELEM *)$1, result == SG_OK ? 0 : JNI_ABORT);
%}
%enddef

SGJ_OUT_BUFFER(void *buf, size_t cap, jbyteArray, byte[], jbyte, GetByteArrayElements, ReleaseByteArrayElements)
SGJ_OUT_BUFFER(char *buf, size_t cap, jbyteArray, byte[], jbyte, GetByteArrayElements, ReleaseByteArrayElements)
SGJ_OUT_BUFFER(char *msg, size_t cap, jbyteArray, byte[], jbyte, GetByteArrayElements, ReleaseByteArrayElements)
SGJ_OUT_BUFFER(uint8_t *bitmap, size_t cap, jbyteArray, byte[], jbyte, GetByteArrayElements, ReleaseByteArrayElements)
SGJ_OUT_BUFFER(float *out, size_t cap, jfloatArray, float[], jfloat, GetFloatArrayElements, ReleaseFloatArrayElements)

/* ---- what the Java API does not expose --------------------------------------------------------
 * Selectors and attention parts take raw float arrays and layouts by pointer (their Java form is a
 * later piece of work); the provider query and metadata blobs serve tools and hosts with their own
 * control channel. Pointer members of the option structs are set by the glue, which owns their
 * lifetime; events are read by the trampoline. */
%ignore sg_selector_s;
%ignore sg_selector_create;
%ignore sg_selector_destroy;
%ignore sg_selector_digest_floats;
%ignore sg_selector_digest;
%ignore sg_selector_input;
%ignore sg_selector_input_init;
%ignore sg_selector_select;
%ignore sg_selector_budget_blocks;
/* The cluster directory (0.4): opened through the glue (sgj_directory_open: its options carry
 * strings the library borrows for the call); the other calls are wrapped as they are. */
%ignore sg_directory_s;
%ignore sg_directory_options;
%ignore sg_directory_options_init;
%ignore sg_directory_options_init_sized;
%ignore sg_directory_open;
/* The layer-written call of device engines: through sgj_transfer_layer_written_ex (the glue), whose
 * arguments are the struct's fields. */
%ignore sg_layer_written;
%ignore sg_layer_written_init;
%ignore sg_layer_written_init_sized;
%ignore sg_transfer_layer_written_ex;
%ignore sg_attention_merge;
%ignore sg_attention_finish;
%ignore sg_provider_info;
%ignore sg_provider_query;
%ignore sg_context_get_metadata;
%ignore sg_session_from_metadata;
%ignore sg_event;
%ignore sg_error_info;
%ignore sg_error_info_init;
%ignore sg_context_create;
%ignore sg_context_destroy;
%ignore sg_kv_register;
%ignore sg_kv_layout_validate;
%ignore sg_kv_layout_plane_bytes;
%ignore sg_kv_layout_region_bytes;
%ignore sg_context_options::provider;
%ignore sg_context_options::local_addr;
%ignore sg_context_options::log_fn;
%ignore sg_context_options::log_user;
%ignore sg_context_options::auth_key;
%ignore sg_context_options::auth_key_len;
%ignore sg_context_options::event_fn;
%ignore sg_context_options::event_user;
%ignore sg_session_options::provider;
%ignore sg_kv_layout::layer_k_base;
%ignore sg_kv_layout::layer_v_base;
%ignore sg_kv_layout::layer_base_count;
%ignore sg_transfer_options::layer_order;
%ignore sg_transfer_options::layer_order_count;

/* ---- the glue (bindings/java/native/glue.c) --------------------------------------------------- */
%typemap(jni) jobjectArray k_buffers, jobjectArray v_buffers "jobjectArray"
%typemap(jtype) jobjectArray k_buffers, jobjectArray v_buffers "java.nio.ByteBuffer[]"
%typemap(jstype) jobjectArray k_buffers, jobjectArray v_buffers "java.nio.ByteBuffer[]"
%typemap(javain) jobjectArray k_buffers, jobjectArray v_buffers "$javainput"

%typemap(jni) jlongArray k_addresses, jlongArray v_addresses "jlongArray"
%typemap(jtype) jlongArray k_addresses, jlongArray v_addresses "long[]"
%typemap(jstype) jlongArray k_addresses, jlongArray v_addresses "long[]"
%typemap(javain) jlongArray k_addresses, jlongArray v_addresses "$javainput"

%typemap(jni) jobject dispatcher "jobject"
%typemap(jtype) jobject dispatcher "io.smartgen.internal.EventDispatcher"
%typemap(jstype) jobject dispatcher "io.smartgen.internal.EventDispatcher"
%typemap(javain) jobject dispatcher "$javainput"

/* The glue is declared after the header, whose types it uses, so the header is read here; the
 * include in smartgen.i that follows is then a no-op (its include guard). */
%include <smartgen/smartgen.h>

sg_status_t sgj_context_create(JNIEnv *jenv_arg, const sg_context_options_t *options, const char *provider,
                               const char *local_addr, jbyteArray auth_key, jobject dispatcher,
                               sg_context_t *out, long long *sink_out);
void sgj_vm_exiting(void);
long long sgj_transfer_layer_state(JNIEnv *jenv_arg, sg_transfer_t xfer, uint32_t layer);
sg_status_t sgj_context_destroy(JNIEnv *jenv_arg, sg_context_t ctx, long long sink);
sg_status_t sgj_kv_register(JNIEnv *jenv_arg, sg_context_t ctx, const sg_kv_layout_t *layout,
                            jobjectArray k_buffers, jobjectArray v_buffers, sg_kv_handle_t *out);
sg_status_t sgj_kv_register_addresses(JNIEnv *jenv_arg, sg_context_t ctx, const sg_kv_layout_t *layout,
                                      jlongArray k_addresses, jlongArray v_addresses, sg_kv_handle_t *out);
sg_status_t sgj_directory_open(sg_context_t ctx, const char *endpoints, const char *prefix, uint32_t lease_ttl_ms,
                               uint32_t request_timeout_ms, sg_directory_t *out);
sg_status_t sgj_transfer_layer_written_ex(sg_transfer_t xfer, uint32_t layer, const float *queries,
                                          long long device_queries, uint32_t num_queries, uint32_t num_q_heads,
                                          uint32_t queries_mem_kind, long long cuda_stream);
