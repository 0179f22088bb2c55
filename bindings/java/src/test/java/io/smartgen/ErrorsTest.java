package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertDoesNotThrow;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

class ErrorsTest {
    static Context context() {
        return Context.builder().provider("tcp").allowUnauthenticated(true).build();
    }

    @Test
    void badLayoutIsInvalidLayoutNamingTheField() {
        try (Context ctx = context()) {
            SmartGenException e = assertThrows(SmartGenException.class,
                    () -> ctx.registerPool(KvLayout.of(2, 0, 64, 16, 8)));
            assertEquals(Status.INVALID_LAYOUT, e.status());
            assertEquals(-3, e.code());
            assertEquals(Status.Category.CALLER_ERROR, e.status().category());
            assertTrue(e.detail().contains("num_kv_heads"), e.detail());
            assertTrue(e.getMessage().startsWith("SG_ERR_INVALID_LAYOUT: "), e.getMessage());

            SmartGenException stride = assertThrows(SmartGenException.class,
                    () -> ctx.registerPool(KvLayout.of(2, 2, 64, 16, 8).withBlockStrideBytes(100)));
            assertEquals(Status.INVALID_LAYOUT, stride.status());
            assertTrue(stride.detail().contains("block_stride_bytes"), stride.detail());
        }
    }

    @Test
    void closedHandlesAnswerInvalidHandle() {
        Context ctx = context();
        Pool pool = ctx.registerPool(KvLayout.of(1, 1, 8, 16, 4));
        Listener listener = ctx.listen("127.0.0.1", 0);
        pool.close();
        listener.close();
        assertEquals(Status.INVALID_HANDLE, assertThrows(SmartGenException.class, () -> pool.k(0)).status());
        assertEquals(Status.INVALID_HANDLE, assertThrows(SmartGenException.class, listener::port).status());
        ctx.close();
        SmartGenException e = assertThrows(SmartGenException.class, ctx::stats);
        assertEquals(Status.INVALID_HANDLE, e.status());
        assertTrue(e.detail().contains("Context"), e.detail());
        assertTrue(ctx.isClosed());
    }

    @Test
    void objectsOfAClosedContextAnswerTheLibrarysInvalidHandle() {
        Context ctx = context();
        Listener listener = ctx.listen("127.0.0.1", 0);
        ctx.close(); // destroys the listener in the library
        SmartGenException e = assertThrows(SmartGenException.class, listener::port);
        assertEquals(Status.INVALID_HANDLE, e.status());
        assertDoesNotThrow(listener::close);
    }

    @Test
    void closingTwiceIsHarmless() throws Exception {
        Pair pair = new Pair();
        Transfer t = pair.decode.expect("twice", pair.dst, new int[] {0}, 16, null);
        Profile profile = Profile.parse("{\"version\":1,\"model\":\"m\",\"num_layers\":3,\"num_kv_heads\":2,"
                + "\"block_tokens\":16,\"defaults\":{\"policy\":\"dense\"}}");
        for (int i = 0; i < 2; i++) {
            t.close();
            profile.close();
            pair.decode.close();
            pair.prefill.close();
            pair.src.close();
            pair.dst.close();
            pair.prefillCtx.close();
            pair.decodeCtx.close();
        }
        assertEquals(Status.INVALID_HANDLE, assertThrows(SmartGenException.class, () -> t.layerState(0)).status());
    }

    @Test
    void aPoolInUseStaysOpenUntilItsTransferIsReleased() throws Exception {
        try (Pair pair = new Pair()) {
            Transfer t = pair.decode.expect("busy", pair.dst, new int[] {0}, 16, null);
            SmartGenException e = assertThrows(SmartGenException.class, pair.dst::close);
            assertEquals(Status.INVALID_STATE, e.status());
            assertDoesNotThrow(() -> pair.dst.k(0)); // still open and usable
            t.close();
            pair.dst.close();
        }
    }

    @Test
    void badInputNamesWhatIsWrong() throws Exception {
        try (Pair pair = new Pair()) {
            SmartGenException twice = assertThrows(SmartGenException.class,
                    () -> pair.decode.expect("dup", pair.dst, new int[] {3, 3}, 32, null));
            assertEquals(Status.INVALID_ARGUMENT, twice.status());
            assertFalse(twice.detail().isEmpty());

            SmartGenException range = assertThrows(SmartGenException.class,
                    () -> pair.decode.expect("far", pair.dst, new int[] {99}, 16, null));
            assertEquals(Status.OUT_OF_RANGE, range.status());

            SmartGenException paths = assertThrows(SmartGenException.class,
                    () -> pair.prefill.post("bits", pair.src, new int[] {0}, 16,
                            TransferOptions.defaults().paths(0x100)));
            assertEquals(Status.INVALID_ARGUMENT, paths.status());
            assertTrue(paths.detail().contains("paths"), paths.detail());

            assertThrows(SmartGenException.class, () -> pair.decode.notify(new byte[0]));
        }
    }

    @Test
    void profileErrorsNameTheFieldAndAMissingFileIsNotFound(@TempDir Path dir) throws Exception {
        SmartGenException e = assertThrows(SmartGenException.class,
                () -> Profile.parse("{\"version\":1,\"model\":\"m\",\"num_layers\":-4}"));
        assertEquals(Status.INVALID_ARGUMENT, e.status());
        assertTrue(e.detail().contains("num_layers"), e.detail());

        Path missing = dir.resolve("absent.json");
        assertEquals(Status.NOT_FOUND, assertThrows(SmartGenException.class, () -> Profile.load(missing)).status());

        String json = "{\"version\":1,\"model\":\"m\",\"num_layers\":2,\"num_kv_heads\":1,\"block_tokens\":16,"
                + "\"defaults\":{\"policy\":\"dense\"}}";
        Path file = Files.writeString(missing.resolveSibling("p.json"), json);
        try (Profile p = Profile.load(file)) {
            assertTrue(p.toJson().matches("(?s).*\"num_layers\":\\s*2\\b.*"), p.toJson());
        }
    }

    @Test
    void unknownCodesKeepTheirNumberAndAreClassedByRange() {
        assertEquals(Status.Category.RETRY_LATER, Status.of(-150).category());
        assertEquals(-150, Status.of(-150).code());
        assertEquals(Status.UNKNOWN_NAME, Status.of(-150).name());
        assertFalse(Status.of(-150).isKnown());
        assertEquals(Status.Category.CALLER_ERROR, Status.of(-42).category());
        assertEquals(Status.Category.PEER_OR_NETWORK, Status.of(-250).category());
        assertEquals(Status.Category.UNSUPPORTED, Status.of(-333).category());
        assertEquals(Status.Category.INTERNAL, Status.of(-399).category());
        assertEquals(Status.Category.INTERNAL, Status.of(-1000).category());
        assertEquals(Status.TIMEOUT, Status.of(-102));
        SmartGenException e = new SmartGenException(-150, "newer");
        assertEquals("SG_STATUS_UNKNOWN(-150): newer", e.getMessage());
    }

    @Test
    void waitsOnAClosedTransferThrowInsteadOfTimingOut() throws Exception {
        try (Pair pair = new Pair()) {
            Transfer t = pair.decode.expect("gone", pair.dst, new int[] {0}, 16, null);
            t.close();
            assertEquals(Status.INVALID_HANDLE,
                    assertThrows(SmartGenException.class, () -> t.await(Duration.ofMillis(1))).status());
        }
    }
}
