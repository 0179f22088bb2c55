package io.smartgen;

import java.nio.charset.StandardCharsets;

/** The library's NUL-terminated text in caller buffers. */
final class Text {
    private Text() {}

    static String fromNulTerminated(byte[] buf) {
        int n = 0;
        while (n < buf.length && buf[n] != 0) {
            n++;
        }
        return new String(buf, 0, n, StandardCharsets.UTF_8);
    }

    static byte[] utf8(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }
}
