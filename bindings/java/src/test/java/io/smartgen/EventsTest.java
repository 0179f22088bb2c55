package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

class EventsTest {
    static final int[] SRC_BLOCKS = {4, 8, 15};
    static final int[] DST_BLOCKS = {16, 23, 1};
    static final long TOKENS = 3 * 16;

    /** What a listener saw, with what it read back through the binding from inside the callback. */
    record Seen(int kind, int layer, Status status, int layerState, Status transferStatus, String thread,
                Status blockingCall, boolean sessionHealthy) {}

    @Test
    @Timeout(60)
    void aListenerCallsBackIntoTheBindingWithoutDeadlock() throws Exception {
        List<Seen> seen = new CopyOnWriteArrayList<>();
        CountDownLatch finished = new CountDownLatch(1);
        Session[] decodeSession = new Session[1];
        EventListener decodeEvents = e -> {
            Transfer t = e.transfer();
            Status blocking = Status.OK;
            try {
                t.await(Duration.ZERO); // a wait from the progress thread is refused, not a deadlock
            } catch (SmartGenException x) {
                blocking = x.status();
            }
            boolean healthy = decodeSession[0] == null || decodeSession[0].error().isEmpty();
            seen.add(new Seen(e.kind(), e.layer(), e.status(), t.layerState(e.layer()), t.status(),
                    Thread.currentThread().getName(), blocking, healthy));
            t.close(); // a borrowed view: releases nothing
            if (e.kind() == Event.FINISHED) {
                finished.countDown();
            }
        };
        AtomicInteger prefillEvents = new AtomicInteger();
        EventListener throwing = e -> {
            prefillEvents.incrementAndGet();
            throw new IllegalStateException("a listener that throws is logged, never left pending");
        };
        try (Pair pair = new Pair(throwing, decodeEvents)) {
            decodeSession[0] = pair.decode;
            Pair.fill(pair.src, SRC_BLOCKS);
            try (Transfer expect = pair.decode.expect("ev", pair.dst, DST_BLOCKS, TOKENS, null);
                 Transfer post = pair.prefill.post("ev", pair.src, SRC_BLOCKS, TOKENS,
                         TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                assertTrue(expect.await(Pair.TIMEOUT));
                assertTrue(post.await(Pair.TIMEOUT));
                assertTrue(finished.await(Pair.TIMEOUT.toSeconds(), TimeUnit.SECONDS), "FINISHED delivered");
                // The transfer still works after its events ran.
                assertEquals(Transfer.LAYER_READY, expect.layerState(0) & Transfer.LAYER_READY);
            }
            assertEquals(0, Pair.mismatches(pair.dst, DST_BLOCKS));
        }
        for (int l = 0; l < Pair.LAYOUT.numLayers(); l++) {
            final int layer = l;
            Seen ready = seen.stream().filter(s -> s.kind == Event.LAYER_READY && s.layer == layer).findFirst()
                    .orElseThrow(() -> new AssertionError("no LAYER_READY for layer " + layer + " in " + seen));
            assertEquals(Status.OK, ready.status);
            assertEquals(Transfer.LAYER_READY, ready.layerState & Transfer.LAYER_READY);
        }
        Seen fin = seen.stream().filter(s -> s.kind == Event.FINISHED).findFirst().orElseThrow();
        assertEquals(Status.OK, fin.status);
        assertEquals(Status.OK, fin.transferStatus);
        for (Seen s : seen) {
            assertEquals(Status.INVALID_STATE, s.blockingCall, "blocking call from the callback: " + s);
            assertNotEquals(Thread.currentThread().getName(), s.thread);
            assertTrue(s.sessionHealthy);
        }
        assertTrue(prefillEvents.get() > 0, "the throwing listener was called");
    }

    /**
     * A listener that throws loses only the event it threw on, and every event of a transfer has
     * run its listener when the transfer's wait returns: 0.4 delivered 0 of the next transfer's 4
     * events when the host closed it right after await (they came 1-2 ms after the wait).
     */
    @Test
    @Timeout(60)
    void aListenerThatThrewOnceGetsEveryEventOfTheNextTransferBeforeItsWaitReturns() throws Exception {
        AtomicInteger thrown = new AtomicInteger();
        List<String> seen = new CopyOnWriteArrayList<>();
        EventListener decodeEvents = e -> {
            if (thrown.getAndIncrement() == 0) {
                throw new IllegalStateException("the first event's listener throws");
            }
            seen.add(e.requestId() + ":" + e.kind());
        };
        try (Pair pair = new Pair(null, decodeEvents)) {
            Pair.fill(pair.src, SRC_BLOCKS);
            for (String rid : new String[] {"first", "second", "third"}) {
                try (Transfer expect = pair.decode.expect(rid, pair.dst, DST_BLOCKS, TOKENS, null);
                     Transfer post = pair.prefill.post(rid, pair.src, SRC_BLOCKS, TOKENS,
                             TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN))) {
                    assertTrue(expect.await(Pair.TIMEOUT));
                    assertTrue(expect.waitQuiesced(Pair.TIMEOUT));
                    assertTrue(post.await(Pair.TIMEOUT));
                }
                // Closed at once: counted without waiting.
                if (!rid.equals("first")) {
                    long n = seen.stream().filter(s -> s.startsWith(rid + ":")).count();
                    assertEquals(Pair.LAYOUT.numLayers() + 2, n, rid + ": events seen when its wait returned: " + seen);
                }
            }
        }
        assertTrue(thrown.get() > 1, "the throwing listener went on being called");
    }

    @Test
    @Timeout(60)
    void manualProgressDeliversEventsOnTheCallingThread() throws Exception {
        List<String> threads = new CopyOnWriteArrayList<>();
        try (Context ctx = Context.builder().provider("tcp").allowUnauthenticated(true).manualProgress(true)
                .eventListener(e -> threads.add(Thread.currentThread().getName())).build()) {
            ctx.progress();
            assertTrue(threads.isEmpty(), "no transfer, no event");
        }
    }
}
