package io.smartgen.internal;

/**
 * Receives a context's transfer events from the JNI trampoline, on the library's progress thread
 * (or inside {@code Context.progress()} without one). Whatever the subclass throws is logged here:
 * an exception must never stay pending on a library thread.
 */
public abstract class EventDispatcher {
    private static final System.Logger LOG = System.getLogger("io.smartgen");

    /** Called by native code only. */
    public final void dispatch(int kind, int layer, int status, long transfer, String requestId, int[] blocks) {
        try {
            deliver(kind, layer, status, transfer, requestId, blocks);
        } catch (Throwable t) {
            LOG.log(System.Logger.Level.WARNING, "SmartGen event listener threw; the event is dropped", t);
        }
    }

    protected abstract void deliver(int kind, int layer, int status, long transfer, String requestId, int[] blocks);
}
