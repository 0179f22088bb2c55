package io.smartgen.internal;

/**
 * Saves the JVM's signal dispositions before libsmartgen is loaded and puts back those the load
 * changed (bindings/java/native/signals.c says why). Used by {@link NativeLoader} only.
 */
final class SignalGuard {
    static final String LIBRARY_NAME = "smartgen_jni_signals";

    private SignalGuard() {}

    static native void save();

    /** Returns the number of dispositions put back. */
    static native int restore();
}
