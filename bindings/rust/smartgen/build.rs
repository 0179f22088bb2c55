//! Gives this crate's tests, examples and binaries the run path smartgen-sys found the library in
//! (only when SMARTGEN_LIB_DIR named one; see smartgen-sys/build.rs).

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_SMARTGEN_RPATH");
    if let Ok(dir) = std::env::var("DEP_SMARTGEN_RPATH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
