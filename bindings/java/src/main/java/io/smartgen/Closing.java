package io.smartgen;

/**
 * close() of every handle-owning object: the handle is released once. SG_ERR_INVALID_HANDLE means
 * the context was closed first and already destroyed the object: no error. SG_ERR_INVALID_STATE
 * (called from an event listener, or a pool still used by a transfer) leaves the object open, so
 * close() can be called again later.
 */
final class Closing {
    private Closing() {}

    interface Release {
        int run(long handle);
    }

    static void release(Handle handle, Release release) {
        long h = handle.take();
        if (h == 0) {
            return;
        }
        try {
            release.run(h);
        } catch (SmartGenException e) {
            if (e.code() == Status.INVALID_STATE.code()) {
                handle.restore(h);
                throw e;
            }
            if (e.code() != Status.INVALID_HANDLE.code()) {
                throw e;
            }
        }
    }
}
