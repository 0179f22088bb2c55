package io.smartgen;

/**
 * The one exception of the binding: a SmartGen call failed. It carries the library's int status
 * (also a code this binding does not know, see {@link Status#of}) and the detail the library gave
 * for that very call.
 *
 * <p>Unchecked, because every call can fail (a closed handle, a lost peer), the status category
 * says what to do far better than a throws clause on each method could, and the calls are used
 * from lambdas and streams in engines; it mirrors {@code UncheckedIOException}. Waits report a
 * timeout by their return value, not by this exception.
 */
public class SmartGenException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final int code;
    private final String detail;

    public SmartGenException(int code, String detail) {
        super(Status.of(code) + (detail == null || detail.isEmpty() ? "" : ": " + detail));
        this.code = code;
        this.detail = detail == null ? "" : detail;
    }

    /** The library's status code, e.g. -3 for SG_ERR_INVALID_LAYOUT. */
    public int code() {
        return code;
    }

    public Status status() {
        return Status.of(code);
    }

    /** The library's sentence (which field, which peer, which errno); may be empty. */
    public String detail() {
        return detail;
    }
}
