package io.smartgen;

import io.smartgen.internal.sg_status_code;
import java.time.Duration;
import java.util.concurrent.atomic.AtomicLong;

/**
 * A library handle held by one Java object: read by every call, taken exactly once by close(), so
 * that closing twice, or from two threads, releases it once. A call racing with close() reaches the
 * library with the old value and gets SG_ERR_INVALID_HANDLE from it, never freed memory (the
 * header's thread-safety rule).
 */
final class Handle {
    private final AtomicLong value;
    private final String kind;

    Handle(long value, String kind) {
        this.value = new AtomicLong(value);
        this.kind = kind;
    }

    long get() {
        long v = value.get();
        if (v == 0) {
            throw new SmartGenException(sg_status_code.SG_ERR_INVALID_HANDLE, "the " + kind + " is closed");
        }
        return v;
    }

    /** The value, once; 0 for every later call. */
    long take() {
        return value.getAndSet(0);
    }

    /** Puts back a value take() returned, when releasing it failed and may be retried. */
    void restore(long v) {
        value.compareAndSet(0, v);
    }

    boolean isClosed() {
        return value.get() == 0;
    }

    /** Nanoseconds for the library; negative durations are 0 (poll), huge ones saturate. */
    static long nanos(Duration timeout) {
        if (timeout.isNegative()) {
            return 0;
        }
        try {
            return timeout.toNanos();
        } catch (ArithmeticException e) {
            return Long.MAX_VALUE;
        }
    }

    /** A long[1] for an out-parameter. */
    static long[] out() {
        return new long[1];
    }
}
