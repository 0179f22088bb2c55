package io.smartgen;

import io.smartgen.internal.smartgen;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;

/**
 * A selection profile (JSON, docs/profiles.md): per layer and KV head, a policy and a budget.
 * Immutable and thread-safe; a transfer posted with it keeps its own copy, so closing the profile
 * while transfers run is fine.
 */
public final class Profile implements AutoCloseable {
    private final Handle handle;

    private Profile(long handle) {
        this.handle = new Handle(handle, "Profile");
        Cleaning.register(this, this.handle, smartgen::sg_profile_destroy, "Profile");
    }

    /** Parses JSON text; SG_ERR_INVALID_ARGUMENT names the bad field. */
    public static Profile parse(String json) {
        long[] out = Handle.out();
        smartgen.sg_profile_parse(json.getBytes(StandardCharsets.UTF_8), out);
        return new Profile(out[0]);
    }

    /** Reads and parses a profile file; SG_ERR_NOT_FOUND when it cannot be read. */
    public static Profile load(Path path) {
        long[] out = Handle.out();
        smartgen.sg_profile_load(path.toString(), out);
        return new Profile(out[0]);
    }

    long handle() {
        return handle.get();
    }

    /** The profile in canonical JSON. */
    public String toJson() {
        long h = handle.get();
        long[] len = Handle.out();
        smartgen.sg_profile_to_json(h, null, len);
        byte[] buf = new byte[(int) len[0] + 1];
        smartgen.sg_profile_to_json(h, buf, len);
        return new String(buf, 0, (int) len[0], StandardCharsets.UTF_8);
    }

    /** Destroys the profile (idempotent). */
    @Override
    public void close() {
        Closing.release(handle, smartgen::sg_profile_destroy);
    }
}
