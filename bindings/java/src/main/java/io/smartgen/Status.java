package io.smartgen;

import io.smartgen.internal.sg_status_code;
import java.util.Map;
import java.util.TreeMap;

/**
 * A SmartGen status: the library's int32 code, its name and what kind of problem it is. Enum-like,
 * but open: a newer library may return codes this binding does not know, which {@link #of} keeps by
 * number and classes by the range the header pins (-1..-99 caller, -100..-199 retry later,
 * -200..-299 peer or network, -300..-399 unsupported, anything else internal).
 */
public final class Status {
    /** What the caller can do about a status, from the header's pinned ranges. */
    public enum Category {
        OK,
        IN_PROGRESS,
        /** -1..-99: the call was wrong; fix it. */
        CALLER_ERROR,
        /** -100..-199: resources; retry later or with less. */
        RETRY_LATER,
        /** -200..-299: the peer, the network or a deadline. */
        PEER_OR_NETWORK,
        /** -300..-398: not supported here. */
        UNSUPPORTED,
        INTERNAL
    }

    private static final Map<Integer, Status> KNOWN = new TreeMap<>();

    public static final Status OK = known(sg_status_code.SG_OK, "SG_OK");
    public static final Status IN_PROGRESS = known(sg_status_code.SG_IN_PROGRESS, "SG_IN_PROGRESS");
    public static final Status INVALID_ARGUMENT = known(sg_status_code.SG_ERR_INVALID_ARGUMENT, "SG_ERR_INVALID_ARGUMENT");
    public static final Status INVALID_HANDLE = known(sg_status_code.SG_ERR_INVALID_HANDLE, "SG_ERR_INVALID_HANDLE");
    public static final Status INVALID_LAYOUT = known(sg_status_code.SG_ERR_INVALID_LAYOUT, "SG_ERR_INVALID_LAYOUT");
    public static final Status LAYOUT_MISMATCH = known(sg_status_code.SG_ERR_LAYOUT_MISMATCH, "SG_ERR_LAYOUT_MISMATCH");
    public static final Status OUT_OF_RANGE = known(sg_status_code.SG_ERR_OUT_OF_RANGE, "SG_ERR_OUT_OF_RANGE");
    public static final Status BUFFER_TOO_SMALL = known(sg_status_code.SG_ERR_BUFFER_TOO_SMALL, "SG_ERR_BUFFER_TOO_SMALL");
    public static final Status INVALID_STATE = known(sg_status_code.SG_ERR_INVALID_STATE, "SG_ERR_INVALID_STATE");
    public static final Status DUPLICATE = known(sg_status_code.SG_ERR_DUPLICATE, "SG_ERR_DUPLICATE");
    public static final Status VERSION_MISMATCH = known(sg_status_code.SG_ERR_VERSION_MISMATCH, "SG_ERR_VERSION_MISMATCH");
    public static final Status NOT_FOUND = known(sg_status_code.SG_ERR_NOT_FOUND, "SG_ERR_NOT_FOUND");
    public static final Status NO_MEMORY = known(sg_status_code.SG_ERR_NO_MEMORY, "SG_ERR_NO_MEMORY");
    public static final Status AGAIN = known(sg_status_code.SG_ERR_AGAIN, "SG_ERR_AGAIN");
    public static final Status TIMEOUT = known(sg_status_code.SG_ERR_TIMEOUT, "SG_ERR_TIMEOUT");
    public static final Status CANCELED = known(sg_status_code.SG_ERR_CANCELED, "SG_ERR_CANCELED");
    public static final Status TRANSPORT = known(sg_status_code.SG_ERR_TRANSPORT, "SG_ERR_TRANSPORT");
    public static final Status PEER_LOST = known(sg_status_code.SG_ERR_PEER_LOST, "SG_ERR_PEER_LOST");
    public static final Status PROTOCOL = known(sg_status_code.SG_ERR_PROTOCOL, "SG_ERR_PROTOCOL");
    public static final Status DEADLINE = known(sg_status_code.SG_ERR_DEADLINE, "SG_ERR_DEADLINE");
    public static final Status CONNECT = known(sg_status_code.SG_ERR_CONNECT, "SG_ERR_CONNECT");
    public static final Status REMOTE = known(sg_status_code.SG_ERR_REMOTE, "SG_ERR_REMOTE");
    public static final Status AUTH_FAILED = known(sg_status_code.SG_ERR_AUTH_FAILED, "SG_ERR_AUTH_FAILED");
    public static final Status AUTH_REQUIRED = known(sg_status_code.SG_ERR_AUTH_REQUIRED, "SG_ERR_AUTH_REQUIRED");
    public static final Status LEASE_EXPIRED = known(sg_status_code.SG_ERR_LEASE_EXPIRED, "SG_ERR_LEASE_EXPIRED");
    public static final Status UNSUPPORTED = known(sg_status_code.SG_ERR_UNSUPPORTED, "SG_ERR_UNSUPPORTED");
    public static final Status NO_PROVIDER = known(sg_status_code.SG_ERR_NO_PROVIDER, "SG_ERR_NO_PROVIDER");
    public static final Status INTERNAL = known(sg_status_code.SG_ERR_INTERNAL, "SG_ERR_INTERNAL");

    /** The name sg_status_str gives a code it does not know. */
    public static final String UNKNOWN_NAME = "SG_STATUS_UNKNOWN";

    private final int code;
    private final String name;
    private final Category category;

    private Status(int code, String name, Category category) {
        this.code = code;
        this.name = name;
        this.category = category;
    }

    private static Status known(int code, String name) {
        Status s = new Status(code, name, categoryOf(code));
        KNOWN.put(code, s);
        return s;
    }

    /** The status of a code; an unknown one keeps its number and is classed by its range. */
    public static Status of(int code) {
        Status s = KNOWN.get(code);
        return s != null ? s : new Status(code, UNKNOWN_NAME, categoryOf(code));
    }

    static Category categoryOf(int code) {
        if (code == sg_status_code.SG_OK) {
            return Category.OK;
        }
        if (code == sg_status_code.SG_IN_PROGRESS) {
            return Category.IN_PROGRESS;
        }
        if (code <= -1 && code >= -99) {
            return Category.CALLER_ERROR;
        }
        if (code <= -100 && code >= -199) {
            return Category.RETRY_LATER;
        }
        if (code <= -200 && code >= -299) {
            return Category.PEER_OR_NETWORK;
        }
        if (code <= -300 && code >= -398) {
            return Category.UNSUPPORTED;
        }
        return Category.INTERNAL;
    }

    public int code() {
        return code;
    }

    /** "SG_ERR_TIMEOUT", or {@link #UNKNOWN_NAME} for a code this binding does not know. */
    public String name() {
        return name;
    }

    public Category category() {
        return category;
    }

    public boolean isKnown() {
        return KNOWN.containsKey(code);
    }

    public boolean isError() {
        return code < 0;
    }

    @Override
    public boolean equals(Object o) {
        return o instanceof Status && ((Status) o).code == code;
    }

    @Override
    public int hashCode() {
        return Integer.hashCode(code);
    }

    @Override
    public String toString() {
        return isKnown() ? name : name + "(" + code + ")";
    }
}
