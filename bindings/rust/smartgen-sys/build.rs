//! Finds and links libsmartgen.so.0, in this order (as libgit2-sys and zstd-sys do, without their
//! crates: this workspace builds offline):
//!
//! 1. `SMARTGEN_LIB_DIR`, when set: that folder (CMake sets it to the build tree's library folder).
//!    It is also the run path of this crate's test binaries and is passed on (DEP_SMARTGEN_RPATH,
//!    through the `links` key) so that the smartgen crate's tests, examples and interop program run
//!    against an uninstalled library without LD_LIBRARY_PATH.
//! 2. `pkg-config smartgen` (the libsmartgen-dev package's smartgen.pc, or a build tree's
//!    smartgen-uninstalled.pc through PKG_CONFIG_PATH): its -L folders. They are also passed on as
//!    DEP_SMARTGEN_RPATH for this workspace's own binaries; Cargo gives a dependency's build script
//!    no way to set another package's run path, so a program outside the workspace linked against
//!    a prefix the loader does not search (not /usr/lib) runs with LD_LIBRARY_PATH or its own
//!    `-C link-arg=-Wl,-rpath,DIR`.
//!    `SMARTGEN_NO_PKG_CONFIG=1` skips it.
//! 3. The system's library path (/usr/lib/<multiarch>, where the libsmartgen0 package installs it).

use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SMARTGEN_LIB_DIR");
    println!("cargo:rerun-if-env-changed=SMARTGEN_NO_PKG_CONFIG");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rustc-link-lib=dylib=smartgen");
    if let Some(dir) = env::var("SMARTGEN_LIB_DIR").ok().filter(|d| !d.is_empty()) {
        println!("cargo:rustc-link-search=native={}", dir);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
        println!("cargo:rpath={}", dir);
        return;
    }
    if env::var("SMARTGEN_NO_PKG_CONFIG").map_or(true, |v| v != "1") {
        if let Some(flags) = pkg_config_libs() {
            let mut rpaths = Vec::new();
            for flag in flags.split_whitespace() {
                if let Some(dir) = flag.strip_prefix("-L") {
                    println!("cargo:rustc-link-search=native={}", dir);
                    // pkg-config leaves the system's folders out of --libs: a -L it gives is a
                    // prefix the loader would not search.
                    rpaths.push(dir.to_string());
                } else if let Some(dir) = flag.strip_prefix("-Wl,-rpath,") {
                    rpaths.push(dir.to_string());
                }
            }
            rpaths.dedup();
            for dir in &rpaths {
                println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
            }
            if let Some(dir) = rpaths.first() {
                println!("cargo:rpath={}", dir);
            }
            return;
        }
    }
    // The default library path: where the libsmartgen0 package puts it.
}

/// `pkg-config --libs smartgen`, or None when pkg-config or the .pc is not there.
fn pkg_config_libs() -> Option<String> {
    let out = Command::new(env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into()))
        .args(["--libs", "smartgen"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8(out.stdout).ok()
}
