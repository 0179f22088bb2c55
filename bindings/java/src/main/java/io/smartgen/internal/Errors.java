package io.smartgen.internal;

import io.smartgen.SmartGenException;
import java.nio.charset.StandardCharsets;

/** Called from the JNI layer to build the exception a failing call throws. */
public final class Errors {
    private Errors() {}

    /** The message arrives as the library's bytes (UTF-8), not as JNI's modified UTF-8. */
    public static Throwable exception(int status, byte[] message) {
        return new SmartGenException(status, new String(message, StandardCharsets.UTF_8));
    }
}
