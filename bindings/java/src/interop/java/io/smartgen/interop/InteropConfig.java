package io.smartgen.interop;

/** The interop program's command line (docs/bindings.md). */
final class InteropConfig {
    static final String USAGE = "usage: smartgen-interop-java --role prefill|decode (--listen ADDR:PORT | --peer ADDR:PORT)\n"
            + "          [--layers N] [--tokens N] [--blocks N] [--no-selective] [--calls N] [--timeout-s N]\n"
            + "  One side of the SmartGen interop transfer (docs/bindings.md). The session key comes from\n"
            + "  the file named by SG_AUTH_KEY_FILE. Defaults: --layers 8 --tokens 1024 --blocks 80\n"
            + "  --timeout-s 60. Prints one result line on stdout; exit status 0 on success, 1 otherwise.";

    String role;
    boolean prefill;
    boolean listen;
    String addr;
    int port;
    int layers = 8;
    int tokens = 1024;
    int blocks = 80;
    boolean selective = true;
    long calls;
    int timeoutS = 60;

    private static Interop.Failure invalid(String message) {
        return new Interop.Failure("SG_ERR_INVALID_ARGUMENT", message);
    }

    /** The role named on a command line that did not parse, for the failure line. */
    static String roleIn(String[] args) {
        for (int i = 0; i + 1 < args.length; i++) {
            if (args[i].equals("--role") && (args[i + 1].equals("prefill") || args[i + 1].equals("decode"))) {
                return args[i + 1];
            }
        }
        return "unknown";
    }

    private static long number(String option, String value, long min, long max) {
        try {
            long v = Long.parseLong(value);
            if (v >= min && v <= max && Character.isDigit(value.charAt(0))) {
                return v;
            }
        } catch (NumberFormatException e) {
            // reported below
        }
        throw invalid(option + " '" + value + "' is not a number from " + min + " to " + max);
    }

    private static int gcd(int a, int b) {
        while (b != 0) {
            int t = a % b;
            a = b;
            b = t;
        }
        return a;
    }

    /** The configuration; null for --help. */
    static InteropConfig parse(String[] args) {
        InteropConfig c = new InteropConfig();
        boolean haveEndpoint = false;
        for (int i = 0; i < args.length; i++) {
            String a = args[i];
            if (a.equals("--help") || a.equals("-h")) {
                return null;
            }
            if (a.equals("--no-selective")) {
                c.selective = false;
                continue;
            }
            if (i + 1 >= args.length) {
                throw invalid(a + " needs a value (or is unknown)");
            }
            String val = args[++i];
            switch (a) {
                case "--role":
                    if (!val.equals("prefill") && !val.equals("decode")) {
                        throw invalid("--role must be prefill or decode, not '" + val + "'");
                    }
                    c.role = val;
                    c.prefill = val.equals("prefill");
                    break;
                case "--listen":
                case "--peer":
                    if (haveEndpoint) {
                        throw invalid("give one of --listen and --peer, once");
                    }
                    c.parseEndpoint(a, val);
                    c.listen = a.equals("--listen");
                    haveEndpoint = true;
                    break;
                case "--layers":
                    c.layers = (int) number(a, val, 1, Integer.MAX_VALUE);
                    break;
                case "--tokens":
                    c.tokens = (int) number(a, val, 1, Integer.MAX_VALUE);
                    break;
                case "--blocks":
                    c.blocks = (int) number(a, val, 1, Integer.MAX_VALUE);
                    break;
                case "--timeout-s":
                    c.timeoutS = (int) number(a, val, 1, Integer.MAX_VALUE);
                    break;
                case "--calls":
                    c.calls = number(a, val, 0, Long.MAX_VALUE);
                    break;
                default:
                    throw invalid("unknown option " + a);
            }
        }
        if (c.role == null || !haveEndpoint) {
            throw invalid("--role and one of --listen / --peer are required");
        }
        if (!c.listen && c.port == 0) {
            throw invalid("--peer needs a port other than 0");
        }
        if (c.tokens % Interop.BLOCK_TOKENS != 0) {
            throw invalid("--tokens " + c.tokens + " is not a multiple of " + Interop.BLOCK_TOKENS);
        }
        int n = c.tokens / Interop.BLOCK_TOKENS;
        // Coprime strides make both tables permutations, so no block is named twice.
        if (c.blocks < n || gcd(c.blocks, Interop.PREFILL_STRIDE) != 1 || gcd(c.blocks, Interop.DECODE_STRIDE) != 1) {
            throw invalid("--blocks " + c.blocks + " must be at least " + n + " (the request's blocks) and coprime to "
                    + Interop.PREFILL_STRIDE + " and " + Interop.DECODE_STRIDE);
        }
        // The on-demand fetch names logical blocks 1, n/2 and n-2.
        if (c.selective && n < 2) {
            throw invalid("the selective transfer needs at least 32 tokens");
        }
        return c;
    }

    /** "ADDR:PORT", ADDR an IPv4 literal or a bracketed IPv6 one ("[::1]:5000"). */
    private void parseEndpoint(String option, String value) {
        int colon = value.lastIndexOf(':');
        if (colon <= 0) {
            throw invalid(option + " '" + value + "' is not ADDR:PORT");
        }
        String host = value.substring(0, colon);
        if (host.length() >= 2 && host.startsWith("[") && host.endsWith("]")) {
            host = host.substring(1, host.length() - 1);
        }
        if (host.isEmpty()) {
            throw invalid(option + " '" + value + "' is not ADDR:PORT");
        }
        addr = host;
        port = (int) number(option, value.substring(colon + 1), 0, 65535);
    }
}
