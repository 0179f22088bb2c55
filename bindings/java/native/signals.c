/* Keeps the JVM's signal handlers across the loading of libsmartgen (libsmartgen_jni_signals.so,
 * loaded first by io.smartgen.internal.NativeLoader; it depends on libc only).
 *
 * The JVM handles SIGSEGV, SIGBUS, SIGILL and SIGFPE itself (implicit null checks, safepoints,
 * stack banging) and uses SIGQUIT, SIGUSR2, SIGINT, SIGTERM and SIGHUP. Loading libsmartgen loads
 * libfabric, whose psm provider (libinfinipath) installs handlers for several of them from its
 * constructor; libsmartgen's constructor then puts those back to the default action, which is
 * right for a C host but, in a JVM, turns the next NullPointerException in compiled code into a
 * crash. So the dispositions are saved before libsmartgen_jni is loaded, and every one that changed
 * during the load is put back as the JVM had it. (Creating and destroying contexts leaves them
 * alone: checked with a host that installs its own handlers.) */
#define _POSIX_C_SOURCE 200809L /* sigaction */
#include <jni.h>
#include <signal.h>

#define MAX_SIGNAL 32 /* the classic signals; real-time ones are nobody's here */

static struct sigaction g_saved[MAX_SIGNAL];
static int g_have_saved[MAX_SIGNAL];

static int same_disposition(const struct sigaction *a, const struct sigaction *b)
{
    if ((a->sa_flags & SA_SIGINFO) != (b->sa_flags & SA_SIGINFO))
        return 0;
    return (a->sa_flags & SA_SIGINFO) ? a->sa_sigaction == b->sa_sigaction : a->sa_handler == b->sa_handler;
}

JNIEXPORT void JNICALL Java_io_smartgen_internal_SignalGuard_save(JNIEnv *env, jclass cls)
{
    int sig;

    (void)env;
    (void)cls;
    for (sig = 1; sig < MAX_SIGNAL; sig++)
        g_have_saved[sig] = sig != SIGKILL && sig != SIGSTOP && sigaction(sig, NULL, &g_saved[sig]) == 0;
}

/* Returns the number of dispositions put back. */
JNIEXPORT jint JNICALL Java_io_smartgen_internal_SignalGuard_restore(JNIEnv *env, jclass cls)
{
    int sig, restored = 0;
    struct sigaction now;

    (void)env;
    (void)cls;
    for (sig = 1; sig < MAX_SIGNAL; sig++) {
        if (!g_have_saved[sig] || sigaction(sig, NULL, &now) != 0 || same_disposition(&now, &g_saved[sig]))
            continue;
        if (sigaction(sig, &g_saved[sig], NULL) == 0)
            restored++;
    }
    return restored;
}
