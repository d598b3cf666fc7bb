//! Link settings for librdist.so, so that a plain `cargo build` produces the
//! library as installed: SONAME `librdist.so.<major>`, only `rdist_*`
//! symbols exported (cmake/rdist.map), and a `librdist.so.<major>` symlink
//! next to the library, so programs linked with `-lrdist` against the build
//! directory find it at run time. It also writes
//! `<target>/<profile>/pkgconfig/rdist.pc` describing that build (headers in
//! include/, the library in the profile directory, an rpath to it), so
//! `PKG_CONFIG_PATH=target/release/pkgconfig pkg-config --cflags --libs rdist`
//! works right after `cargo build --release`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cmake/rdist.map");
    println!("cargo:rerun-if-env-changed=RDIST_VERSION_SCRIPT");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return; // SONAMEs and version scripts as below are for ELF/Linux
    }
    let soname = format!(
        "librdist.so.{}",
        env::var("CARGO_PKG_VERSION_MAJOR").unwrap()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");

    // rustc passes its own version script (exactly the #[no_mangle] exports)
    // to the linker. GNU ld refuses a second one ("anonymous version tag
    // cannot be combined with other version tags"); lld takes both.
    let map = Path::new(env!("CARGO_MANIFEST_DIR")).join("cmake/rdist.map");
    let wanted = match env::var("RDIST_VERSION_SCRIPT").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => links_with_lld(),
    };
    if wanted {
        println!(
            "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
            map.display()
        );
    }

    if let Some(dir) = profile_dir() {
        link_soname(&dir, &soname);
        write_pkg_config(&dir);
    }
}

/// Whether rustc links this target with lld: its default for
/// x86_64-unknown-linux-gnu since Rust 1.90, unless the flags choose
/// another linker.
fn links_with_lld() -> bool {
    if env::var("TARGET").as_deref() != Ok("x86_64-unknown-linux-gnu") {
        return false;
    }
    let flags = env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    if flags.contains("fuse-ld=lld") || flags.contains("linker-features=+lld") {
        return true;
    }
    if [
        "linker-features",
        "link-self-contained",
        "linker-flavor",
        "fuse-ld",
    ]
    .iter()
    .any(|f| flags.contains(f))
    {
        return false; // another linker, or not sure: leave rustc's list alone
    }
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let Ok(out) = Command::new(rustc).arg("--version").output() else {
        return false;
    };
    // "rustc 1.95.0 (59807616e 2026-04-14)"
    let text = String::from_utf8_lossy(&out.stdout);
    let mut parts = text
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .split('.')
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 90)
}

/// target/<profile> (or target/<triple>/<profile>): OUT_DIR is
/// <that>/build/rdist-<hash>/out.
fn profile_dir() -> Option<PathBuf> {
    let out = PathBuf::from(env::var_os("OUT_DIR")?);
    let build = out.parent()?.parent()?;
    if build.file_name()? != "build" {
        return None;
    }
    Some(build.parent()?.to_path_buf())
}

/// Writes <dir>/pkgconfig/rdist.pc for this (uninstalled) build: the
/// headers of this checkout, the library in <dir>, and an rpath to <dir> in
/// Libs, so a program linked with `pkg-config --libs rdist` finds
/// librdist.so.<major> at run time without LD_LIBRARY_PATH. (The installed
/// rdist.pc comes from cmake/rdist.pc.in.) Rewritten only when it changes.
fn write_pkg_config(dir: &Path) {
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    let version = env::var("CARGO_PKG_VERSION").unwrap();
    // What `rustc --print native-static-libs` lists for librdist.a on Linux
    // (as RDIST_STATIC_SYSTEM_LIBS in cmake/rdistTargets.cmake).
    let text = format!(
        "# rdist {version} as built by cargo in {dir} (written by build.rs):\n\
         # not installed. Libs carries -Wl,-rpath to this directory, so programs\n\
         # linked with `pkg-config --libs rdist` find librdist.so at run time;\n\
         # if you copy them elsewhere, set LD_LIBRARY_PATH or install rdist\n\
         # (cmake --install) and use the installed rdist.pc instead.\n\
         libdir={dir}\n\
         includedir={include}\n\
         \n\
         Name: rdist\n\
         Description: Collective communication for native training engines (uninstalled build)\n\
         Version: {version}\n\
         Cflags: -I${{includedir}}\n\
         Libs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lrdist\n\
         Libs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl\n",
        dir = dir.display(),
        include = include.display(),
    );
    let pc_dir = dir.join("pkgconfig");
    let pc = pc_dir.join("rdist.pc");
    if std::fs::read_to_string(&pc).is_ok_and(|old| old == text) {
        return;
    }
    if let Err(e) = std::fs::create_dir_all(&pc_dir).and_then(|()| std::fs::write(&pc, text)) {
        println!("cargo:warning=could not write {}: {e}", pc.display());
    }
}

/// Makes <dir>/<soname> a symlink to librdist.so (it dangles until the
/// library is linked, moments later).
fn link_soname(dir: &Path, soname: &str) {
    let link = dir.join(soname);
    if std::fs::read_link(&link).is_ok_and(|t| t == Path::new("librdist.so")) {
        return;
    }
    let _ = std::fs::remove_file(&link);
    if let Err(e) = std::os::unix::fs::symlink("librdist.so", &link) {
        println!("cargo:warning=could not create {}: {e}", link.display());
    }
}
