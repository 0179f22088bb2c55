package io.smartgen.examples;

import io.smartgen.Context;
import io.smartgen.Event;
import io.smartgen.KvLayout;
import io.smartgen.Listener;
import io.smartgen.Pool;
import io.smartgen.Profile;
import io.smartgen.Session;
import io.smartgen.SmartGenException;
import io.smartgen.Transfer;
import io.smartgen.TransferOptions;
import io.smartgen.TransferStats;
import java.nio.ByteBuffer;
import java.nio.file.Path;
import java.security.SecureRandom;
import java.time.Duration;
import java.util.BitSet;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.stream.IntStream;

/**
 * Selective KV transfer: the three selective paths together, with a profile, between two contexts
 * of this JVM (an engine pair would run them in two processes, as TransferPair does).
 *
 * <ol>
 *   <li>proactive: as prefill marks each layer written, its essential blocks (the profile's sinks and
 *       recent window, here 1/8 of the blocks) and the layer's page digests go at once;</li>
 *   <li>on demand: once layer 0's essential blocks are in, the decode side scores the blocks it
 *       still lacks from the digests (an all-ones query: the sum of each block's per-element maxima)
 *       and fetches the two best, which go before any other traffic;</li>
 *   <li>speculative: whatever is left follows in the background until decode holds everything.</li>
 * </ol>
 * Prefill writes layer 0 first and the others only after the fetch, as a forward pass would go on
 * while the decode side already looks at the first layer.
 * Decode-side events (essential layers, fetched blocks) are counted by a listener.
 *
 * <p>Usage: Selective [--profile FILE.json] [--provider NAME]. Exit status 0 when every byte arrived.
 */
public final class Selective {
    // Llama-shaped planes (32 KiB) and a request of 2048 tokens, so that the speculative path takes a
    // while and the fetch has something left to ask for.
    static final KvLayout LAYOUT = KvLayout.of(4, 8, 128, 16, 160);
    static final int TOKENS = 2048; // 128 blocks
    static final int N = TOKENS / LAYOUT.tokensPerBlock();
    static final int[] SRC_BLOCKS = IntStream.range(0, N).map(i -> (i * 37 + 11) % 160).toArray();
    static final int[] DST_BLOCKS = IntStream.range(0, N).map(i -> (i * 29 + 5) % 160).toArray();
    static final String PROFILE = "{\"version\":1,\"model\":\"example\",\"num_layers\":4,\"num_kv_heads\":8,"
            + "\"block_tokens\":16,\"defaults\":{\"policy\":\"sinks_recent\",\"budget\":{\"fraction\":0.125},"
            + "\"sinks\":16,\"recent\":64}}";
    static final Duration TIMEOUT = Duration.ofSeconds(20);

    static byte value(int layer, int plane, int logical, int offset) {
        return (byte) (layer * 31 + plane * 17 + logical * 13 + offset * 3);
    }

    static void fill(Pool pool, int[] blocks) {
        for (int l = 0; l < LAYOUT.numLayers(); l++) {
            for (int p = 0; p < 2; p++) {
                for (int i = 0; i < blocks.length; i++) {
                    ByteBuffer plane = pool.plane(l, p, blocks[i]);
                    for (int o = 0; o < plane.capacity(); o++) {
                        plane.put(o, value(l, p, i, o));
                    }
                }
            }
        }
    }

    static long mismatches(Pool pool, int[] blocks) {
        long bad = 0;
        for (int l = 0; l < LAYOUT.numLayers(); l++) {
            for (int p = 0; p < 2; p++) {
                for (int i = 0; i < blocks.length; i++) {
                    ByteBuffer plane = pool.plane(l, p, blocks[i]);
                    for (int o = 0; o < plane.capacity(); o++) {
                        bad += plane.get(o) == value(l, p, i, o) ? 0 : 1;
                    }
                }
            }
        }
        return bad;
    }

    /**
     * The two best blocks not yet resident, by the upper bound of q.k for an all-ones query: the
     * sum of the block's per-element key maxima (digests: [block][kv_head][min|max][head_dim]).
     */
    static int[] bestMissing(float[] digests, BitSet resident) {
        int perBlock = LAYOUT.numKvHeads() * 2 * LAYOUT.headDim();
        double[] score = new double[N];
        for (int b = 0; b < N; b++) {
            for (int h = 0; h < LAYOUT.numKvHeads(); h++) {
                int max = b * perBlock + (h * 2 + 1) * LAYOUT.headDim();
                for (int i = 0; i < LAYOUT.headDim(); i++) {
                    score[b] += digests[max + i];
                }
            }
        }
        return IntStream.range(0, N).filter(b -> !resident.get(b)).boxed()
                .sorted((a, b) -> Double.compare(score[b], score[a])).limit(2).mapToInt(Integer::intValue).toArray();
    }

    public static void main(String[] args) throws Exception {
        String provider = "tcp";
        Path profileFile = null;
        for (int i = 0; i + 1 < args.length; i += 2) {
            if (args[i].equals("--profile")) {
                profileFile = Path.of(args[i + 1]);
            } else if (args[i].equals("--provider")) {
                provider = args[i + 1];
            }
        }
        byte[] key = new byte[32];
        new SecureRandom().nextBytes(key);
        AtomicInteger essentialEvents = new AtomicInteger();
        AtomicInteger blocksEvents = new AtomicInteger();
        try (Context prefillCtx = Context.builder().provider(provider).authKey(key).build();
             Context decodeCtx = Context.builder().provider(provider).authKey(key).eventListener(e -> {
                 if (e.kind() == Event.ESSENTIAL_READY) {
                     essentialEvents.incrementAndGet();
                 } else if (e.kind() == Event.BLOCKS_READY) {
                     blocksEvents.incrementAndGet();
                 }
             }).build();
             Profile profile = profileFile != null ? Profile.load(profileFile) : Profile.parse(PROFILE);
             Listener listener = decodeCtx.listen("127.0.0.1", 0)) {
            CompletableFuture<Session> accepted = CompletableFuture.supplyAsync(() -> listener.accept(TIMEOUT));
            try (Session prefill = prefillCtx.connect("127.0.0.1", listener.port(), TIMEOUT);
                 Session decode = accepted.get(TIMEOUT.toSeconds(), TimeUnit.SECONDS);
                 Pool src = prefillCtx.registerPool(LAYOUT);
                 Pool dst = decodeCtx.registerPool(LAYOUT)) {
                prefill.exportPool(src);
                decode.exportPool(dst);
                fill(src, SRC_BLOCKS);
                TransferOptions selective = TransferOptions.defaults()
                        .paths(TransferOptions.PATH_PROACTIVE | TransferOptions.PATH_ON_DEMAND
                                | TransferOptions.PATH_SPECULATIVE)
                        .profile(profile)
                        .lease(Duration.ofSeconds(30));
                try (Transfer in = decode.expect("sel-1", dst, DST_BLOCKS, TOKENS, null);
                     Transfer out = prefill.post("sel-1", src, SRC_BLOCKS, TOKENS, selective)) {
                    out.layerWritten(0); // the forward pass finished layer 0
                    if (!in.waitLayerState(0, Transfer.LAYER_ESSENTIAL, TIMEOUT)) {
                        throw new IllegalStateException("layer 0: essential blocks late");
                    }
                    BitSet resident = in.residency(0);
                    int[] wanted = bestMissing(in.digests(0), resident);
                    System.out.printf("layer 0: %d of %d blocks in place after the proactive path; fetching %s%n",
                            resident.cardinality(), N, java.util.Arrays.toString(wanted));
                    if (wanted.length > 0) {
                        in.fetch(0, wanted);
                        if (!in.waitBlocks(0, wanted, TIMEOUT)) {
                            throw new IllegalStateException("fetched blocks late");
                        }
                    }
                    for (int l = 1; l < LAYOUT.numLayers(); l++) {
                        out.layerWritten(l);
                    }
                    for (int l = 1; l < LAYOUT.numLayers(); l++) {
                        if (!in.waitLayerState(l, Transfer.LAYER_ESSENTIAL, TIMEOUT)) {
                            throw new IllegalStateException("layer " + l + ": essential blocks late");
                        }
                    }
                    // The speculative path brings the rest.
                    if (!in.await(TIMEOUT)) {
                        throw new IllegalStateException("the transfer did not complete within " + TIMEOUT);
                    }
                    if (!out.await(TIMEOUT)) {
                        throw new IllegalStateException("prefill did not see the confirmation within " + TIMEOUT);
                    }
                    TransferStats s = in.stats();
                    System.out.printf("bytes by path: proactive %d, on demand %d, speculative %d; digests %d; "
                            + "%d fetch requests%n", s.bytesProactive(), s.bytesOnDemand(), s.bytesSpeculative(),
                            s.digestBytes(), s.fetchRequests());
                }
                long bad = mismatches(dst, DST_BLOCKS);
                System.out.printf("events: %d essential layers, %d fetches done; %s%n", essentialEvents.get(),
                        blocksEvents.get(), bad == 0 ? "every byte arrived" : bad + " bytes differ");
                System.exit(bad == 0 ? 0 : 1);
            }
        } catch (SmartGenException e) {
            System.err.println("selective: " + e.getMessage());
            System.exit(1);
        }
    }
}
