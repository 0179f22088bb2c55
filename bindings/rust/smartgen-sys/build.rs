//! Links libsmartgen.so.0. The library is looked for in SMARTGEN_LIB_DIR (CMake sets it to the
//! build tree's library folder), else in /usr/lib where the libsmartgen0 package installs it. There
//! is no pkg-config lookup: a build needs nothing beyond rustc and the library.
//!
//! A SMARTGEN_LIB_DIR that is given is also the run path of this crate's test binaries and is passed
//! on (DEP_SMARTGEN_RPATH, through the `links` key) so that the smartgen crate's tests, examples and
//! interop program run against an uninstalled library without LD_LIBRARY_PATH.

use std::env;

fn main() {
    println!("cargo:rerun-if-env-changed=SMARTGEN_LIB_DIR");
    let given = env::var("SMARTGEN_LIB_DIR")
        .ok()
        .filter(|dir| !dir.is_empty());
    let lib_dir = given.clone().unwrap_or_else(|| "/usr/lib".to_string());
    println!("cargo:rustc-link-search=native={}", lib_dir);
    println!("cargo:rustc-link-lib=dylib=smartgen");
    if let Some(dir) = given {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
        println!("cargo:rpath={}", dir);
    }
}
