//! The shape of the library stays true: data flows one way,
//! ffi -> comm -> backend -> algorithms -> transport, with rendezvous
//! beside backend (comm uses both; neither uses the other), and the base
//! modules below everything. Read from the sources' `crate::` paths: a
//! module that names a layer above its own fails this test. Also: no
//! loops between the files of one layer, and environment variables are
//! read only in options.rs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module and its layer (higher may use lower).
fn layer_of(module: &str) -> Option<u32> {
    Some(match module {
        "ffi" => 6,
        "comm" => 5,
        "backend" | "rendezvous" => 4,
        "algorithms" => 3,
        "transport" => 2,
        "auth" | "call" | "descriptor" | "dtype" | "reduce" | "copy" | "error" | "options"
        | "log" | "trace" | "test_rng" => 1,
        _ => return None,
    })
}

/// Library sources (src/bin holds programs that use the public API).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().unwrap() != "bin" {
                sources(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file: src/backend/nccl/mod.rs -> [backend, nccl].
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Code without comments (doc comments mention modules freely).
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter_map(|(i, l)| {
        let code = match l.find("//") {
            Some(at) => &l[..at],
            None => l,
        };
        (!code.trim().is_empty()).then_some((i + 1, code))
    })
}

/// Every `crate::a::b` named on a line, as [a, b] (b when it is a module
/// name, i.e. lower case).
fn crate_paths(line: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `mycrate::`
        }
        let mut parts = Vec::new();
        for seg in rest.split("::") {
            let name: String = seg
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
                break;
            }
            parts.push(name.clone());
            if seg.len() != name.len() || parts.len() == 2 {
                break;
            }
        }
        if !parts.is_empty() {
            found.push(parts);
        }
    }
    found
}

/// The upward imports in `files` (module path, text), as messages.
fn upward_imports(files: &[(Vec<String>, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (module, text) in files {
        let Some(top) = module.first() else {
            continue; // lib.rs: the crate root re-exports every layer
        };
        let Some(mine) = layer_of(top) else {
            bad.push(format!(
                "{}: module `{top}` has no layer in tests/layers.rs",
                module.join("::")
            ));
            continue;
        };
        for (n, line) in code_lines(text) {
            for path in crate_paths(line) {
                let used = &path[0];
                if used == top {
                    continue;
                }
                match layer_of(used) {
                    Some(theirs) if theirs < mine || (theirs == 1 && mine == 1) => {}
                    Some(_) => bad.push(format!(
                        "{} (line {n}) uses crate::{used}, which is not below it: {}",
                        module.join("::"),
                        line.trim()
                    )),
                    None => {}
                }
            }
        }
    }
    bad
}

/// Loops between the files (second-level modules) of one layer, e.g.
/// comm::group <-> comm::queue or backend::cuda <-> backend::nccl.
fn loops(files: &[(Vec<String>, String)]) -> Vec<String> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, text) in files {
        if module.len() < 2 {
            continue;
        }
        let (top, me) = (&module[0], &module[1]);
        for (_, line) in code_lines(text) {
            let mut named: Vec<String> = crate_paths(line)
                .into_iter()
                .filter(|p| p.len() == 2 && &p[0] == top)
                .map(|p| p[1].clone())
                .collect();
            // `super::x` from a file directly in the layer's folder.
            if module.len() == 2 {
                let mut rest = line;
                while let Some(at) = rest.find("super::") {
                    rest = &rest[at + "super::".len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if name.starts_with(|c: char| c.is_ascii_lowercase()) {
                        named.push(name);
                    }
                }
            }
            for other in named {
                if &other != me {
                    edges
                        .entry(format!("{top}::{me}"))
                        .or_default()
                        .insert(format!("{top}::{other}"));
                }
            }
        }
    }
    let mut found = Vec::new();
    for (a, outs) in &edges {
        for b in outs {
            if a < b && edges.get(b).is_some_and(|back| back.contains(a)) {
                found.push(format!("{a} <-> {b}"));
            }
        }
    }
    found
}

fn library() -> Vec<(Vec<String>, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    files
        .iter()
        .map(|f| (module_path(&src, f), std::fs::read_to_string(f).unwrap()))
        .collect()
}

#[test]
fn no_module_imports_a_layer_above_it() {
    let files = library();
    assert!(files.len() > 40, "read only {} files", files.len());
    let bad = upward_imports(&files);
    assert!(
        bad.is_empty(),
        "imports against the layering:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_files_of_a_layer_form_no_loops() {
    let found = loops(&library());
    assert!(
        found.is_empty(),
        "loops between files:\n{}",
        found.join("\n")
    );
}

#[test]
fn environment_variables_are_read_only_in_options() {
    let mut bad = Vec::new();
    for (module, text) in library() {
        if module == ["options"] {
            continue;
        }
        for (n, line) in code_lines(&text) {
            if line.contains("env::var") || line.contains("getenv") {
                bad.push(format!("{} line {n}: {}", module.join("::"), line.trim()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "environment read outside options.rs:\n{}",
        bad.join("\n")
    );
}

/// The checks themselves can fail: fed an upward import and a loop, they
/// report both.
#[test]
fn the_checks_catch_an_upward_import_and_a_loop() {
    let files = vec![
        (
            vec!["transport".to_string(), "stream".to_string()],
            "use crate::error::Result;\nuse crate::backend::engine::Engine; // upward".to_string(),
        ),
        (
            vec!["comm".to_string(), "group".to_string()],
            "use super::queue::Runner;".to_string(),
        ),
        (
            vec!["comm".to_string(), "queue".to_string()],
            "fn f() { crate::comm::group::active(); }".to_string(),
        ),
    ];
    let bad = upward_imports(&files);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].contains("transport::stream (line 2) uses crate::backend"),
        "{bad:?}"
    );
    assert_eq!(
        loops(&files),
        vec!["comm::group <-> comm::queue".to_string()]
    );
}
