package io.smartgen;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.Test;

/** A JNI library that cannot be loaded is reported with what is missing and where it was looked for. */
class LoaderTest {
    /** Touches the binding in a JVM of its own (this one has loaded the library already). */
    public static final class Probe {
        static int length(String s) {
            return s.length();
        }

        public static void main(String[] args) {
            try {
                System.out.println("loaded " + Context.libraryVersion());
            } catch (UnsatisfiedLinkError e) {
                System.out.println(e.getMessage());
                System.exit(3);
            }
            if (args.length > 0 && args[0].equals("npe")) {
                // Compiled code checks for null by taking SIGSEGV: this loop dies if loading the
                // library left the JVM without its handler.
                long caught = 0;
                for (int i = 0; i < 3_000_000; i++) {
                    try {
                        length(i % 1000 == 999 ? null : "abc");
                    } catch (NullPointerException e) {
                        caught++;
                    }
                }
                System.out.println("caught " + caught);
            }
            if (args.length > 0 && args[0].equals("exit-open")) {
                exitWithOpenContexts();
            }
        }

        /**
         * System.exit while contexts are open and their progress threads attached to the VM (by an
         * event): the library's exit handler destroys the contexts and joins those threads.
         */
        static void exitWithOpenContexts() {
            java.util.concurrent.CountDownLatch finished = new java.util.concurrent.CountDownLatch(1);
            try {
                Pair pair = new Pair(e -> { }, e -> {
                    if (e.kind() == Event.FINISHED) {
                        finished.countDown();
                    }
                });
                Transfer expect = pair.decode.expect("exit", pair.dst, new int[] {0}, 16, null);
                pair.prefill.post("exit", pair.src, new int[] {1}, 16,
                        TransferOptions.defaults().flags(TransferOptions.ALL_LAYERS_WRITTEN));
                System.out.println("finished " + (expect.await(Pair.TIMEOUT)
                        && finished.await(Pair.TIMEOUT.toSeconds(), TimeUnit.SECONDS)));
            } catch (Exception e) {
                System.out.println("failed " + e);
            }
            System.exit(0);
        }
    }

    /** Where a class was loaded from (the console launcher's own class path holds only itself). */
    static String location(Class<?> cls) {
        try {
            return Path.of(cls.getProtectionDomain().getCodeSource().getLocation().toURI()).toString();
        } catch (java.net.URISyntaxException e) {
            throw new IllegalStateException(e);
        }
    }

    record Run(int exit, String out) {}

    static Run run(List<String> jvmArgs, String... args) throws IOException, InterruptedException {
        List<String> cmd = new ArrayList<>();
        cmd.add(Path.of(System.getProperty("java.home"), "bin", "java").toString());
        cmd.addAll(jvmArgs);
        cmd.add("-cp");
        cmd.add(location(Probe.class) + java.io.File.pathSeparator + location(Context.class));
        cmd.add(Probe.class.getName());
        cmd.addAll(List.of(args));
        Process p = new ProcessBuilder(cmd).redirectErrorStream(true).start();
        boolean ended = p.waitFor(60, TimeUnit.SECONDS);
        if (!ended) {
            p.destroyForcibly();
        }
        String out = new String(p.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
        assertTrue(ended, "the probe did not end within 60 s: " + out);
        return new Run(p.exitValue(), out);
    }

    /** The output of a probe that must fail to load the library. */
    static String probe(String... jvmArgs) throws IOException, InterruptedException {
        Run r = run(List.of(jvmArgs));
        assertNotEquals(0, r.exit(), r.out());
        return r.out();
    }

    /** This JVM's way to the library, for a probe that loads it. */
    static List<String> libraryArgs() {
        String jni = System.getProperty("smartgen.jni.path");
        return jni != null ? List.of("-Dsmartgen.jni.path=" + jni)
                : List.of("-Djava.library.path=" + System.getProperty("java.library.path"));
    }

    @Test
    void exitingWithOpenContextsDoesNotHang() throws Exception {
        Run r = run(libraryArgs(), "exit-open");
        assertEquals(0, r.exit(), r.out());
        assertTrue(r.out().contains("finished true"), r.out());
    }

    @Test
    void theJvmKeepsItsSignalHandlersOnceTheLibraryIsLoaded() throws Exception {
        Run r = run(libraryArgs(), "npe");
        assertEquals(0, r.exit(), r.out());
        assertTrue(r.out().contains("caught 3000"), r.out());
    }

    @Test
    void aMissingLibraryOnTheSearchPathIsNamed() throws Exception {
        String out = probe("-Djava.library.path=/nonexistent-sg-dir");
        assertTrue(out.contains("libsmartgen_jni.so"), out);
        assertTrue(out.contains("java.library.path=/nonexistent-sg-dir"), out);
        assertTrue(out.contains("libsmartgen.so.0"), out);
        assertTrue(out.contains("-Dsmartgen.jni.path"), out);
    }

    @Test
    void aMissingExplicitPathIsNamed() throws Exception {
        String out = probe("-Dsmartgen.jni.path=/nonexistent-sg-dir/libsmartgen_jni.so");
        assertTrue(out.contains("-Dsmartgen.jni.path=/nonexistent-sg-dir/libsmartgen_jni.so"), out);
        assertTrue(out.contains("libsmartgen.so.0"), out);
    }

    @Test
    void theLoadedLibraryIsTheOneThisBindingWasBuiltFor() {
        assertEquals(0, io.smartgen.internal.smartgen.sg_abi_version());
        // The header the binding was generated from names the version the library must have.
        final String built = io.smartgen.internal.smartgenConstants.SG_VERSION_MAJOR + "."
                + io.smartgen.internal.smartgenConstants.SG_VERSION_MINOR + ".";
        assertTrue(Context.libraryVersion().startsWith(built), Context.libraryVersion() + " vs " + built);
    }
}
