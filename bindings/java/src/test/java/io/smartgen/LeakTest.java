package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.SecureRandom;
import java.time.Duration;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Memory and descriptors stay flat over many cycles of two contexts, a session, two pools and a
 * transfer, everything closed (0.4 grew about 1 MB a cycle in Java). {@code smartgen.leak.cycles}
 * sets the count (default 200; the release phase's java_leak runs 800 by default); shm contexts, which take
 * milliseconds to make.
 */
class LeakTest {
    static final int[] BLOCKS = {4, 8, 15};

    static long rssKiB() throws IOException {
        for (String line : Files.readAllLines(Path.of("/proc/self/status"))) {
            if (line.startsWith("VmRSS:")) {
                return Long.parseLong(line.replaceAll("[^0-9]", ""));
            }
        }
        return -1;
    }

    /**
     * Resident memory less the JVM's own non-heap (JIT code cache, metaspace), which grows while
     * the JIT compiles the cycle's code; the heap is fixed and pre-touched by java_leak's options.
     */
    static long nativeKiB() throws IOException {
        long nonHeap = java.lang.management.ManagementFactory.getMemoryMXBean().getNonHeapMemoryUsage().getCommitted();
        return rssKiB() - nonHeap / 1024;
    }

    static long fds() throws IOException {
        try (var s = Files.list(Path.of("/proc/self/fd"))) {
            return s.count();
        }
    }

    static void cycle(byte[] key) throws Exception {
        try (Context a = Context.builder().provider("shm").authKey(key).build();
             Context b = Context.builder().provider("shm").authKey(key).build()) {
            Session sa;
            Session sb;
            try (Listener listener = b.listen("127.0.0.1", 0)) {
                var accepted = java.util.concurrent.CompletableFuture.supplyAsync(() -> listener.accept(Pair.TIMEOUT));
                sa = a.connect("127.0.0.1", listener.port(), Pair.TIMEOUT);
                sb = accepted.get(Pair.TIMEOUT.toSeconds(), java.util.concurrent.TimeUnit.SECONDS);
            }
            try (sa; sb; Pool pa = a.registerPool(Pair.LAYOUT); Pool pb = b.registerPool(Pair.LAYOUT)) {
                sa.exportPool(pa);
                sb.exportPool(pb);
                try (Transfer y = sb.expect("leak", pb, BLOCKS, 48, null);
                     Transfer x = sa.post("leak", pa, BLOCKS, 48,
                             TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                    assertTrue(y.await(Duration.ofSeconds(20)));
                    assertTrue(x.await(Duration.ofSeconds(20)));
                }
            }
        }
    }

    /**
     * A leak grows with every cycle; the allocator's arenas grow only until the load they see has
     * been met once, in steps, so after a warm-up of a quarter the bound is on the median slope of the
     * measured half's four quarters. Runs as java_leak (-Dsmartgen.leak.cycles, 800 by default).
     */
    @Test
    @Timeout(900)
    void cyclesLeakNeitherMemoryNorDescriptors() throws Exception {
        String prop = System.getProperty("smartgen.leak.cycles");
        org.junit.jupiter.api.Assumptions.assumeTrue(prop != null,
                "the leak test runs as java_leak (800 cycles by default); set -Dsmartgen.leak.cycles to run it here");
        int cycles = Math.max(4, Integer.parseInt(prop));
        byte[] key = new byte[32];
        new SecureRandom().nextBytes(key);
        for (int i = 0; i < cycles / 4; i++) {
            cycle(key);
        }
        // Four quarters of the measured half; the bound is on the median quarter's slope: a leak
        // grows in every quarter, an arena step in one.
        System.gc();
        long[] rss = new long[5];
        rss[0] = nativeKiB();
        long fd0 = fds();
        long start = System.nanoTime();
        for (int q = 1; q <= 4; q++) {
            for (int i = 0; i < cycles / 8; i++) {
                cycle(key);
            }
            System.gc();
            rss[q] = nativeKiB();
        }
        long fd1 = fds();
        double[] slopes = new double[4];
        for (int q = 0; q < 4; q++) {
            slopes[q] = (double) (rss[q + 1] - rss[q]) / (cycles / 8);
        }
        java.util.Arrays.sort(slopes);
        double perCycle = (slopes[1] + slopes[2]) / 2;
        System.out.printf("[ info ] java, %d cycles in %.1f s: RSS less JVM non-heap by quarter %s KiB (median %.1f KiB a cycle), fds %d -> %d%n",
                cycles, (System.nanoTime() - start) / 1e9, java.util.Arrays.toString(rss), perCycle, fd0, fd1);
        assertTrue(fd1 <= fd0 + 4, "descriptors grew from " + fd0 + " to " + fd1);
        assertTrue(perCycle <= 16, "RSS grew a median " + perCycle + " KiB a cycle over the quarters "
                + java.util.Arrays.toString(rss) + " KiB");
    }
}
