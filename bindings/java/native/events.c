/* The transfer event trampoline: library thread -> io.smartgen.internal.EventDispatcher.
 *
 * The progress thread is a native thread: it is attached to the VM once, as a daemon (it must not
 * keep the VM alive), on its first event, and detached by a thread-local destructor when it exits.
 * Each event runs in its own local frame, since an attached native thread never returns to Java
 * to drop its local references. Whatever the listener throws is caught by the dispatcher and
 * logged there; anything left pending here (an OutOfMemoryError building the arguments) is
 * printed and cleared, never left on the library's thread. */
#include "glue.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

static JavaVM *g_vm;
static jmethodID g_dispatch; /* EventDispatcher.dispatch(int kind, int layer, int status, long transfer,
                                String requestId, int[] blocks) */
static pthread_key_t g_attached; /* set on the threads this file attached */
/* Set by the binding's shutdown hook. The VM's exit runs the C exit handlers, where the library's
 * static registry destroys the contexts left open and joins their progress threads: a thread that
 * then detached (or called into Java) would wait for the exiting VM forever, so from that point
 * on threads leave without detaching and events are no longer delivered. */
static int g_vm_exiting;

void sgj_vm_exiting(void)
{
    __atomic_store_n(&g_vm_exiting, 1, __ATOMIC_SEQ_CST);
}

static int vm_exiting(void)
{
    return __atomic_load_n(&g_vm_exiting, __ATOMIC_SEQ_CST);
}

static void detach_at_exit(void *env)
{
    (void)env;
    if (!vm_exiting())
        (*g_vm)->DetachCurrentThread(g_vm);
}

int sgj_events_init(JavaVM *vm, JNIEnv *env)
{
    jclass cls = (*env)->FindClass(env, "io/smartgen/internal/EventDispatcher");

    if (cls == NULL)
        return 0;
    g_dispatch = (*env)->GetMethodID(env, cls, "dispatch", "(IIIJLjava/lang/String;[I)V");
    if (g_dispatch == NULL)
        return 0;
    g_vm = vm;
    return pthread_key_create(&g_attached, detach_at_exit) == 0;
}

static JNIEnv *current_env(void)
{
    JNIEnv *env = NULL;
    JavaVMAttachArgs args;
    jint rc = (*g_vm)->GetEnv(g_vm, (void **)&env, JNI_VERSION_1_8);

    if (rc == JNI_OK)
        return env; /* a Java thread (sg_context_progress), or one attached before */
    if (rc != JNI_EDETACHED)
        return NULL;
    args.version = JNI_VERSION_1_8;
    args.name = (char *)"smartgen-events";
    args.group = NULL;
    if ((*g_vm)->AttachCurrentThreadAsDaemon(g_vm, (void **)&env, &args) != JNI_OK)
        return NULL;
    pthread_setspecific(g_attached, env);
    return env;
}

/* The fields this header knows, read only as far as the library's struct_size reaches. */
#define HAS_FIELD(event, field) ((event)->struct_size >= offsetof(sg_event_t, field) + sizeof((event)->field))

void sgj_on_event(void *user, const sg_event_t *event)
{
    JNIEnv *env;
    jstring request_id = NULL;
    jintArray blocks = NULL;

    if (vm_exiting())
        return;
    env = current_env();
    if (env == NULL || event == NULL || (*env)->PushLocalFrame(env, 4) != 0)
        return;
    if (HAS_FIELD(event, request_id) && event->request_id != NULL)
        request_id = (*env)->NewStringUTF(env, event->request_id);
    if (HAS_FIELD(event, num_blocks) && event->blocks != NULL && event->num_blocks > 0 &&
        !(*env)->ExceptionCheck(env)) {
        blocks = (*env)->NewIntArray(env, (jsize)event->num_blocks);
        if (blocks != NULL)
            (*env)->SetIntArrayRegion(env, blocks, 0, (jsize)event->num_blocks, (const jint *)event->blocks);
    }
    if (!(*env)->ExceptionCheck(env))
        (*env)->CallVoidMethod(env, (jobject)user, g_dispatch, (jint)event->kind,
                               (jint)(HAS_FIELD(event, layer) ? event->layer : 0),
                               (jint)(HAS_FIELD(event, status) ? event->status : SG_OK),
                               (jlong)(uintptr_t)(HAS_FIELD(event, transfer) ? event->transfer : NULL),
                               request_id, blocks);
    if ((*env)->ExceptionCheck(env)) {
        (*env)->ExceptionDescribe(env);
        (*env)->ExceptionClear(env);
    }
    (*env)->PopLocalFrame(env, NULL);
}
