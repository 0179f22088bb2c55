/* JNI glue of the Java binding (see glue.h): errors, context creation, pool registration. */
#define _DEFAULT_SOURCE /* explicit_bzero */
#include "glue.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* io.smartgen.internal.Errors.exception(int, byte[]): the message crosses as bytes because the
 * library's text need not be the modified UTF-8 that NewStringUTF insists on. */
static jclass g_errors;
static jmethodID g_errors_exception;

JNIEXPORT jint JNICALL JNI_OnLoad(JavaVM *vm, void *reserved)
{
    JNIEnv *env = NULL;
    jclass cls;

    (void)reserved;
    if ((*vm)->GetEnv(vm, (void **)&env, JNI_VERSION_1_8) != JNI_OK)
        return JNI_ERR;
    cls = (*env)->FindClass(env, "io/smartgen/internal/Errors");
    if (cls == NULL)
        return JNI_ERR;
    g_errors = (*env)->NewGlobalRef(env, cls);
    g_errors_exception = (*env)->GetStaticMethodID(env, cls, "exception", "(I[B)Ljava/lang/Throwable;");
    if (g_errors == NULL || g_errors_exception == NULL || !sgj_events_init(vm, env))
        return JNI_ERR;
    return JNI_VERSION_1_8;
}

void sgj_throw(JNIEnv *env, sg_status_t status, const char *message)
{
    jsize len;
    jbyteArray bytes;
    jobject exception;

    /* An exception already pending (an OutOfMemoryError while copying arguments) says more. */
    if ((*env)->ExceptionCheck(env))
        return;
    if (message == NULL)
        message = "";
    len = (jsize)strlen(message);
    bytes = (*env)->NewByteArray(env, len);
    if (bytes == NULL)
        return;
    (*env)->SetByteArrayRegion(env, bytes, 0, len, (const jbyte *)message);
    exception = (*env)->CallStaticObjectMethod(env, g_errors, g_errors_exception, (jint)status, bytes);
    if (exception != NULL && !(*env)->ExceptionCheck(env))
        (*env)->Throw(env, (jthrowable)exception);
}

int sgj_check_out(JNIEnv *env, jlongArray out)
{
    jclass cls;

    if (out != NULL && (*env)->GetArrayLength(env, out) >= 1)
        return 1;
    cls = (*env)->FindClass(env, "java/lang/IllegalArgumentException");
    if (cls != NULL)
        (*env)->ThrowNew(env, cls, "an out-parameter needs a long[] of at least one element");
    return 0;
}

uint32_t *sgj_copy_ints(JNIEnv *env, jintArray array)
{
    jsize n;
    uint32_t *copy;

    if (array == NULL)
        return NULL;
    n = (*env)->GetArrayLength(env, array);
    /* One element at least, so that an empty table is a valid pointer with a count of 0. */
    copy = malloc(((size_t)n + 1) * sizeof *copy);
    if (copy == NULL) {
        jclass cls = (*env)->FindClass(env, "java/lang/OutOfMemoryError");
        if (cls != NULL)
            (*env)->ThrowNew(env, cls, "copying a block table");
        return NULL;
    }
    (*env)->GetIntArrayRegion(env, array, 0, n, (jint *)copy);
    return copy;
}

static void throw_java(JNIEnv *env, const char *class_name, const char *message)
{
    jclass cls = (*env)->FindClass(env, class_name);

    if (cls != NULL)
        (*env)->ThrowNew(env, cls, message);
}

sg_status_t sgj_context_create(JNIEnv *env, const sg_context_options_t *options, const char *provider,
                               const char *local_addr, jbyteArray auth_key, jobject dispatcher,
                               sg_context_t *out, long long *sink_out)
{
    sg_context_options_t opts;
    unsigned char *key = NULL;
    jsize key_len = 0;
    jobject sink = NULL;
    sg_status_t status;

    if (options != NULL)
        opts = *options;
    else
        sg_context_options_init(&opts);
    opts.provider = provider;
    opts.local_addr = local_addr;
    if (auth_key != NULL) {
        /* A copy of our own, wiped after the call (the library keeps its own copy). */
        key_len = (*env)->GetArrayLength(env, auth_key);
        key = malloc((size_t)key_len + 1);
        if (key == NULL) {
            throw_java(env, "java/lang/OutOfMemoryError", "copying the authentication key");
            return SG_ERR_NO_MEMORY;
        }
        (*env)->GetByteArrayRegion(env, auth_key, 0, key_len, (jbyte *)key);
        opts.auth_key = key;
        opts.auth_key_len = (size_t)key_len;
    }
    if (dispatcher != NULL) {
        sink = (*env)->NewGlobalRef(env, dispatcher);
        if (sink == NULL) {
            status = SG_ERR_NO_MEMORY;
            goto done;
        }
        opts.event_fn = sgj_on_event;
        opts.event_user = sink;
    }
    status = sg_context_create(&opts, out, NULL);
    if (status == SG_OK)
        *sink_out = (long long)(uintptr_t)sink;
    else if (sink != NULL)
        (*env)->DeleteGlobalRef(env, sink);
done:
    if (key != NULL) {
        explicit_bzero(key, (size_t)key_len);
        free(key);
    }
    return status;
}

sg_status_t sgj_context_destroy(JNIEnv *env, sg_context_t ctx, long long sink)
{
    sg_status_t status = sg_context_destroy(ctx);

    /* SG_ERR_INVALID_STATE (called from a callback) leaves the context, and so its sink, alive. */
    if ((status == SG_OK || status == SG_ERR_INVALID_HANDLE) && sink != 0)
        (*env)->DeleteGlobalRef(env, (jobject)(uintptr_t)sink);
    return status;
}

/* Fills bases[0..n) with the addresses of the direct buffers in array (NULL for a null element or
 * a heap buffer, which the library then names). */
static void buffer_addresses(JNIEnv *env, jobjectArray array, jsize n, void **bases)
{
    jsize i;

    for (i = 0; i < n; i++) {
        jobject buffer = (*env)->GetObjectArrayElement(env, array, i);
        bases[i] = buffer != NULL ? (*env)->GetDirectBufferAddress(env, buffer) : NULL;
        if (buffer != NULL)
            (*env)->DeleteLocalRef(env, buffer);
    }
}

sg_status_t sgj_kv_register(JNIEnv *env, sg_context_t ctx, const sg_kv_layout_t *layout,
                            jobjectArray k_buffers, jobjectArray v_buffers, sg_kv_handle_t *out)
{
    sg_kv_layout_t l;
    jsize nk = k_buffers != NULL ? (*env)->GetArrayLength(env, k_buffers) : 0;
    jsize nv = v_buffers != NULL ? (*env)->GetArrayLength(env, v_buffers) : 0;
    void **k = NULL, **v = NULL;
    sg_status_t status;

    if (layout == NULL) {
        throw_java(env, "java/lang/NullPointerException", "layout");
        return SG_ERR_INVALID_ARGUMENT;
    }
    if (v_buffers != NULL && nv != nk) {
        throw_java(env, "java/lang/IllegalArgumentException", "as many V buffers as K buffers are needed");
        return SG_ERR_INVALID_ARGUMENT;
    }
    k = calloc((size_t)nk + 1, sizeof *k);
    v = calloc((size_t)nv + 1, sizeof *v);
    if (k == NULL || v == NULL) {
        free(k);
        free(v);
        throw_java(env, "java/lang/OutOfMemoryError", "the layer base arrays");
        return SG_ERR_NO_MEMORY;
    }
    l = *layout;
    buffer_addresses(env, k_buffers, nk, k);
    buffer_addresses(env, v_buffers, nv, v);
    l.layer_k_base = k_buffers != NULL ? (void *const *)k : NULL;
    l.layer_v_base = v_buffers != NULL ? (void *const *)v : NULL;
    l.layer_base_count = (size_t)nk;
    status = sg_kv_register(ctx, &l, out, NULL);
    free(k);
    free(v);
    return status;
}

sg_status_t sgj_kv_register_addresses(JNIEnv *env, sg_context_t ctx, const sg_kv_layout_t *layout,
                                      jlongArray k_addresses, jlongArray v_addresses, sg_kv_handle_t *out)
{
    sg_kv_layout_t l;
    jsize nk = k_addresses != NULL ? (*env)->GetArrayLength(env, k_addresses) : 0;
    jsize nv = v_addresses != NULL ? (*env)->GetArrayLength(env, v_addresses) : 0;
    jlong *ka, *va = NULL;
    sg_status_t status;

    if (layout == NULL || k_addresses == NULL) {
        throw_java(env, "java/lang/NullPointerException", layout == NULL ? "layout" : "kAddresses");
        return SG_ERR_INVALID_ARGUMENT;
    }
    if (v_addresses != NULL && nv != nk) {
        throw_java(env, "java/lang/IllegalArgumentException", "as many V addresses as K addresses are needed");
        return SG_ERR_INVALID_ARGUMENT;
    }
    ka = (*env)->GetLongArrayElements(env, k_addresses, NULL);
    if (v_addresses != NULL)
        va = (*env)->GetLongArrayElements(env, v_addresses, NULL);
    if (ka == NULL || (v_addresses != NULL && va == NULL)) {
        if (ka != NULL)
            (*env)->ReleaseLongArrayElements(env, k_addresses, ka, JNI_ABORT);
        return SG_ERR_NO_MEMORY; /* the VM has thrown OutOfMemoryError */
    }
    /* jlong and void * are both 64 bits here (the header refuses other targets). */
    l = *layout;
    l.layer_k_base = (void *const *)ka;
    l.layer_v_base = (void *const *)va;
    l.layer_base_count = (size_t)nk;
    status = sg_kv_register(ctx, &l, out, NULL);
    (*env)->ReleaseLongArrayElements(env, k_addresses, ka, JNI_ABORT);
    if (va != NULL)
        (*env)->ReleaseLongArrayElements(env, v_addresses, va, JNI_ABORT);
    return status;
}

sg_status_t sgj_directory_open(sg_context_t ctx, const char *endpoints, const char *prefix, uint32_t lease_ttl_ms,
                               uint32_t request_timeout_ms, sg_directory_t *out)
{
    sg_directory_options_t o;

    sg_directory_options_init(&o);
    o.endpoints = endpoints;
    o.prefix = prefix;
    o.lease_ttl_ms = lease_ttl_ms;
    o.request_timeout_ms = request_timeout_ms;
    return sg_directory_open(ctx, &o, out, NULL);
}

sg_status_t sgj_transfer_layer_written_ex(sg_transfer_t xfer, uint32_t layer, const float *queries,
                                          long long device_queries, uint32_t num_queries, uint32_t num_q_heads,
                                          uint32_t queries_mem_kind, long long cuda_stream)
{
    sg_layer_written_t a;

    sg_layer_written_init(&a);
    a.queries = queries != NULL ? queries : (const float *)(uintptr_t)device_queries;
    a.num_queries = num_queries;
    a.num_q_heads = num_q_heads;
    a.queries_mem_kind = queries_mem_kind;
    a.cuda_stream = (void *)(uintptr_t)cuda_stream;
    return sg_transfer_layer_written_ex(xfer, layer, &a);
}

long long sgj_transfer_layer_state(JNIEnv *env, sg_transfer_t xfer, uint32_t layer)
{
    uint32_t state = 0;
    sg_status_t status = sg_transfer_layer_state(xfer, layer, &state);

    if (status < 0) {
        sgj_throw(env, status, sg_last_error_message());
        return 0;
    }
    return (long long)state;
}
