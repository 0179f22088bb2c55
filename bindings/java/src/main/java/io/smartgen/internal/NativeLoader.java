package io.smartgen.internal;

import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;

/**
 * Loads the JNI library (libsmartgen_jni.so, which links libsmartgen.so.0) once, from
 * {@code -Dsmartgen.jni.path=/abs/path/libsmartgen_jni.so} when that property is set, else from the
 * natives classifier jar on the class path ({@code META-INF/native/linux-x86_64/}, extracted to a
 * private temporary folder), else from where an install puts it relative to this jar
 * ({@code <prefix>/share/java/smartgen.jar} and {@code <prefix>/<libdir>/jni/}: an install under a
 * prefix of one's own, which no JVM's path holds), else by name from {@code java.library.path}. Its companion libsmartgen_jni_signals.so (found the same way:
 * next to the named file, or on the path) is loaded first, to keep the JVM's signal handlers
 * across the load (see {@link SignalGuard}). A failure is rethrown with everything needed to fix
 * it: which library, where it was looked for, and the usual cause (libsmartgen.so.0 not on the
 * loader's path).
 */
public final class NativeLoader {
    public static final String PATH_PROPERTY = "smartgen.jni.path";
    public static final String LIBRARY_NAME = "smartgen_jni";

    private static boolean loaded;

    private NativeLoader() {}

    public static synchronized void load() {
        if (loaded) {
            return;
        }
        String explicit = System.getProperty(PATH_PROPERTY);
        File file = explicit != null && !explicit.isEmpty() ? new File(explicit).getAbsoluteFile() : fromClassPath();
        if (file == null) {
            file = besideTheJar();
        }
        File signals = file == null ? null : new File(file.getParentFile(), System.mapLibraryName(SignalGuard.LIBRARY_NAME));
        loadOne(signals, SignalGuard.LIBRARY_NAME);
        SignalGuard.save();
        try {
            loadOne(file, LIBRARY_NAME);
        } finally {
            SignalGuard.restore();
        }
        loaded = true;
        // Contexts still open when the VM exits are destroyed by the library's own exit handler,
        // which joins their progress threads: those must not wait for the exiting VM (glue events.c).
        Runtime.getRuntime().addShutdownHook(new Thread(smartgen::sgj_vm_exiting, "smartgen-vm-exit"));
    }

    private static final String NATIVES = "/META-INF/native/linux-x86_64/";

    /**
     * The JNI library from a natives jar on the class path, copied (with its signal companion) into
     * a new private folder, since the loader needs a file; null when no such jar is there.
     */
    private static File fromClassPath() {
        String jni = System.mapLibraryName(LIBRARY_NAME);
        String signals = System.mapLibraryName(SignalGuard.LIBRARY_NAME);
        if (!"amd64".equals(System.getProperty("os.arch")) || NativeLoader.class.getResource(NATIVES + jni) == null) {
            return null;
        }
        try {
            Path dir = Files.createTempDirectory("smartgen-jni");
            dir.toFile().deleteOnExit();
            for (String name : new String[] {signals, jni}) {
                try (InputStream in = NativeLoader.class.getResourceAsStream(NATIVES + name)) {
                    if (in == null) {
                        throw new IOException(NATIVES + name + " is missing from the natives jar");
                    }
                    Path out = dir.resolve(name);
                    Files.copy(in, out, StandardCopyOption.REPLACE_EXISTING);
                    out.toFile().deleteOnExit();
                }
            }
            return dir.resolve(jni).toFile();
        } catch (IOException e) {
            UnsatisfiedLinkError err = new UnsatisfiedLinkError("SmartGen's natives jar could not be unpacked: " + e.getMessage());
            err.initCause(e);
            throw err;
        }
    }

    /**
     * The JNI library where cmake --install put it beside this jar: the jar in
     * {@code <prefix>/share/java}, the library in {@code <prefix>/lib/jni} (or lib64, or a Debian
     * multiarch libdir); null when this class was not loaded from such a jar or nothing is there.
     */
    private static File besideTheJar() {
        try {
            java.security.CodeSource source = NativeLoader.class.getProtectionDomain().getCodeSource();
            if (source == null) {
                return null;
            }
            File jar = new File(source.getLocation().toURI());
            File java = jar.getParentFile();
            File share = java == null ? null : java.getParentFile();
            File prefix = share == null ? null : share.getParentFile();
            if (prefix == null || !jar.isFile() || !"java".equals(java.getName()) || !"share".equals(share.getName())) {
                return null;
            }
            String jni = System.mapLibraryName(LIBRARY_NAME);
            for (String libdir : new String[] {"lib", "lib64", "lib/x86_64-linux-gnu"}) {
                File candidate = new File(new File(new File(prefix, libdir), "jni"), jni);
                if (candidate.isFile()) {
                    return candidate;
                }
            }
        } catch (Exception e) {
            // A class path entry that is not a file: java.library.path is next.
        }
        return null;
    }

    private static void loadOne(File file, String name) {
        try {
            if (file != null) {
                System.load(file.getPath());
            } else {
                System.loadLibrary(name);
            }
        } catch (UnsatisfiedLinkError e) {
            UnsatisfiedLinkError clear = new UnsatisfiedLinkError(explain(file, name, e));
            clear.initCause(e);
            throw clear;
        }
    }

    private static String explain(File file, String name, UnsatisfiedLinkError e) {
        String where = file != null
                ? "from " + file + " (-D" + PATH_PROPERTY + "=" + System.getProperty(PATH_PROPERTY) + ")"
                : "as " + System.mapLibraryName(name) + " on java.library.path="
                        + System.getProperty("java.library.path")
                        + " (or name libsmartgen_jni.so with -D" + PATH_PROPERTY + "=/abs/path/"
                        + System.mapLibraryName(LIBRARY_NAME) + ", "
                        + System.mapLibraryName(SignalGuard.LIBRARY_NAME) + " next to it)";
        return "SmartGen's JNI library could not be loaded " + where + ": " + e.getMessage()
                + ". It needs libsmartgen.so.0 too: when the error names libsmartgen.so.0, put the"
                + " directory holding it on LD_LIBRARY_PATH or install the libsmartgen0 package.";
    }
}
