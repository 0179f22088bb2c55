package io.smartgen;

import io.smartgen.internal.sg_transfer_options_t;
import io.smartgen.internal.sg_wire_quant;
import io.smartgen.internal.smartgen;
import io.smartgen.internal.smartgenConstants;
import java.time.Duration;
import java.util.function.Consumer;

/**
 * Options of an expect or post. Everything unset is the library's default: the full path, no
 * flags, priority 0, no deadline, no lease, the default profile.
 */
public final class TransferOptions {
    /** Every block, layer by layer (excludes the selective paths). */
    public static final int PATH_FULL = (int) smartgenConstants.SG_PATH_FULL;
    /** Each layer's essential blocks (chosen with the profile) and page digests, as it is written. */
    public static final int PATH_PROACTIVE = (int) smartgenConstants.SG_PATH_PROACTIVE;
    /** The decode side may fetch blocks it lacks ({@link Transfer#fetch}). */
    public static final int PATH_ON_DEMAND = (int) smartgenConstants.SG_PATH_ON_DEMAND;
    /** Whatever has not been sent goes in the background at the lowest priority. */
    public static final int PATH_SPECULATIVE = (int) smartgenConstants.SG_PATH_SPECULATIVE;
    /** Post: every layer is already written; send at once. */
    public static final int ALL_LAYERS_WRITTEN = (int) smartgenConstants.SG_TRANSFER_ALL_LAYERS_WRITTEN;
    /** The KV travels as the pools hold it (the default). */
    public static final int WIRE_QUANT_NONE = sg_wire_quant.SG_WIRE_QUANT_NONE;
    /** One-byte int8 codes with a scale per block, plane and KV head (lossy; both sides the same). */
    public static final int WIRE_QUANT_INT8 = sg_wire_quant.SG_WIRE_QUANT_INT8;
    /** One-byte FP8 E4M3 codes with a scale per block, plane and KV head (lossy; both sides the same). */
    public static final int WIRE_QUANT_FP8_E4M3 = sg_wire_quant.SG_WIRE_QUANT_FP8_E4M3;

    private int paths;
    private int flags;
    private int priority;
    private long deadlineNs;
    private long leaseNs;
    private Profile profile;
    private int wireQuant;

    public static TransferOptions defaults() {
        return new TransferOptions();
    }

    /** PATH_* bits. */
    public TransferOptions paths(int paths) {
        this.paths = paths;
        return this;
    }

    /** ALL_LAYERS_WRITTEN, or 0. */
    public TransferOptions flags(int flags) {
        this.flags = flags;
        return this;
    }

    /** Higher first among this context's transfers. */
    public TransferOptions priority(int priority) {
        this.priority = priority;
        return this;
    }

    /** The transfer fails with SG_ERR_DEADLINE unless complete this long after the call. */
    public TransferOptions deadline(Duration deadline) {
        this.deadlineNs = Math.max(1, Handle.nanos(deadline));
        return this;
    }

    /** Post side, selective paths: how long the blocks stay available after the last layer. */
    public TransferOptions lease(Duration lease) {
        this.leaseNs = Math.max(1, Handle.nanos(lease));
        return this;
    }

    /** In-flight quantization, WIRE_QUANT_*: both sides must give the same (fp32/fp16/bf16 pools). */
    public TransferOptions wireQuant(int wireQuant) {
        this.wireQuant = wireQuant;
        return this;
    }

    /** Post side with PATH_PROACTIVE: the profile that decides each layer's essential blocks. */
    public TransferOptions profile(Profile profile) {
        this.profile = profile;
        return this;
    }

    /** Runs call with the native form of options (null: the defaults), freed afterwards. */
    static void withNative(TransferOptions options, Consumer<sg_transfer_options_t> call) {
        sg_transfer_options_t o = new sg_transfer_options_t();
        try {
            smartgen.sg_transfer_options_init(o);
            if (options != null) {
                o.setPaths(options.paths);
                o.setFlags(options.flags);
                o.setPriority(options.priority);
                o.setDeadline_ns(options.deadlineNs);
                o.setLease_ns(options.leaseNs);
                o.setWire_quant(options.wireQuant);
                o.setProfile(options.profile == null ? 0 : options.profile.handle());
            }
            call.accept(o);
        } finally {
            o.delete();
        }
    }
}
