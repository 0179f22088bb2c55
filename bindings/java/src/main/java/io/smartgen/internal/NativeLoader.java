package io.smartgen.internal;

import java.io.File;

/**
 * Loads the JNI library (libsmartgen_jni.so, which links libsmartgen.so.0) once, from
 * {@code -Dsmartgen.jni.path=/abs/path/libsmartgen_jni.so} when that property is set, else by name
 * from {@code java.library.path}. Its companion libsmartgen_jni_signals.so (found the same way:
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
        File file = explicit != null && !explicit.isEmpty() ? new File(explicit).getAbsoluteFile() : null;
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
