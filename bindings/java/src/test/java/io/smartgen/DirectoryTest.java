package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.File;
import java.net.ServerSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.SecureRandom;
import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Assumptions;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Two contexts that know only an etcd endpoint and a name: one publishes and accepts, the other
 * connects by name, and a transfer moves every byte (a one-member etcd started for the test).
 */
class DirectoryTest {
    static final int[] SRC_BLOCKS = {4, 8, 15};
    static final int[] DST_BLOCKS = {16, 23, 1};

    /** A port that binds now, below the kernel's ephemeral range: one the kernel handed out and took
     *  back could go to another process's socket before etcd binds it. */
    static int freePort() throws Exception {
        java.util.Random random = new java.util.Random();
        for (int attempt = 0; attempt < 200; attempt++) {
            int port = 20000 + random.nextInt(12000);
            try (ServerSocket s = new ServerSocket(port, 1, java.net.InetAddress.getLoopbackAddress())) {
                return s.getLocalPort();
            } catch (java.io.IOException taken) {
                // in use: another
            }
        }
        throw new IllegalStateException("no free port in 20000-31999");
    }

    @Test
    @Timeout(120)
    void publishConnectAcceptTransfer() throws Exception {
        Assumptions.assumeTrue(new File("/usr/bin/etcd").canExecute(),
                "needs etcd (Debian's etcd-server; scripts/setup-deps.sh installs it)");
        String client = "http://127.0.0.1:" + freePort();
        String peer = "http://127.0.0.1:" + freePort();
        Path data = Files.createTempDirectory("etcd");
        Process etcd = new ProcessBuilder("/usr/bin/etcd", "--name", "m0", "--data-dir", data.toString(),
                "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer, "--initial-cluster", "m0=" + peer, "--log-level", "error",
                "--logger", "zap").redirectErrorStream(true).redirectOutput(ProcessBuilder.Redirect.DISCARD).start();
        byte[] key = new byte[32];
        new SecureRandom().nextBytes(key);
        try (Context a = Context.builder().provider("tcp").authKey(key).build();
             Context b = Context.builder().provider("tcp").authKey(key).build()) {
            Directory da = null;
            long until = System.nanoTime() + 20_000_000_000L;
            while (da == null) { // the member elects itself first
                try {
                    da = a.openDirectory(client, null, Duration.ofSeconds(2), null);
                    da.publish("prefill/java-0", Duration.ofSeconds(5));
                } catch (SmartGenException e) {
                    if (da != null) {
                        da.close();
                        da = null;
                    }
                    assertTrue(System.nanoTime() < until, "etcd never answered: " + e);
                    Thread.sleep(100);
                }
            }
            try (Directory pub = da; Directory db = b.openDirectory(client, null, null, null)) {
                Duration t = Duration.ofSeconds(5);
                assertEquals(java.util.List.of("prefill/java-0"), db.list("prefill/", t));
                assertEquals(java.util.List.of(), db.list("decode/", t));
                assertTrue(db.lookup("prefill/java-0", t).orElseThrow().length > 0);
                assertTrue(db.lookup("prefill/none", t).isEmpty());
                assertTrue(db.await("prefill/java-0", true, t));
                long before = System.nanoTime();
                assertFalse(db.await("prefill/none", true, Duration.ofMillis(300)));
                assertTrue(System.nanoTime() - before >= 250_000_000L);
                CompletableFuture<Session> accepted = CompletableFuture.supplyAsync(() -> pub.accept(Duration.ofSeconds(20)));
                try (Session sb = db.connect("prefill/java-0", Duration.ofSeconds(20));
                     Session sa = accepted.get(20, TimeUnit.SECONDS);
                     Pool src = a.registerPool(Pair.LAYOUT);
                     Pool dst = b.registerPool(Pair.LAYOUT)) {
                    Pair.fill(src, SRC_BLOCKS);
                    sa.exportPool(src);
                    sb.exportPool(dst);
                    try (Transfer y = sb.expect("by-name", dst, DST_BLOCKS, 48, null);
                         Transfer x = sa.post("by-name", src, SRC_BLOCKS, 48,
                                 TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                        assertTrue(y.await(Pair.TIMEOUT));
                        assertTrue(x.await(Pair.TIMEOUT));
                    }
                    assertEquals(0, Pair.mismatches(dst, DST_BLOCKS));
                }
                Directory.Stats st = pub.stats();
                assertEquals(1, st.sessionsAccepted());
                assertTrue(st.requests() > 0 && st.leasesGranted() > 0, st.toString());
                pub.unpublish("prefill/java-0", Duration.ofSeconds(5));
                assertTrue(db.await("prefill/java-0", false, t));
                assertTrue(db.lookup("prefill/java-0", t).isEmpty());
            }
        } finally {
            etcd.destroyForcibly().waitFor();
        }
    }
}
