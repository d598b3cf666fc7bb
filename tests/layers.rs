//! The shape of the library stays true: data flows one way,
//! ffi -> comm -> backend -> algorithms -> transport, with rendezvous
//! beside backend (comm uses both; neither uses the other), and the base
//! modules below everything. Read from the sources: every `use` (grouped
//! and nested ones expanded) and every `crate::`, `super::` and `self::`
//! path, resolved to the module it names, at any depth. A module that
//! names a layer above its own fails; so does a circle anywhere between
//! the modules of one parent (siblings, at any depth: a file that uses
//! a sibling folder's file counts for the folders). Also: environment
//! variables are read only in options.rs, and docs/architecture.md names
//! every file of src/ and no file that is not there.

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
        | "log" | "trace" | "test_rng" | "sync" | "random" => 1,
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

/// A source file's code as tokens: identifiers, `::`, and single
/// punctuation characters, with comments, strings and character
/// literals left out (so that doc comments and messages may name
/// modules freely). Each token carries its line.
fn tokens(text: &str) -> Vec<(usize, String)> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0usize, 1usize);
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(b[i] == '\n');
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && {
            // A raw string: r"..." or r#"..."#.
            let hashes = b[i + 1..].iter().take_while(|c| **c == '#').count();
            b.get(i + 1 + hashes) == Some(&'"')
        } {
            let hashes = b[i + 1..].iter().take_while(|c| **c == '#').count();
            i += 2 + hashes;
            loop {
                if i >= b.len() {
                    break;
                }
                if b[i] == '"'
                    && b[i + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|c| **c == '#')
                        .count()
                        == hashes
                {
                    i += 1 + hashes;
                    break;
                }
                line += usize::from(b[i] == '\n');
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                line += usize::from(b.get(i) == Some(&'\n'));
                i += 1;
            }
            i += 1;
        } else if c == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime.
            if next == Some('\\') {
                i += 2;
                while i < b.len() && b[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if b.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push((line, b[start..i].iter().collect()));
        } else if c == ':' && next == Some(':') {
            out.push((line, "::".into()));
            i += 2;
        } else if c.is_whitespace() {
            i += 1;
        } else {
            out.push((line, c.to_string()));
            i += 1;
        }
    }
    out
}

/// A path named in a file: the module it was named in (inline modules
/// such as `mod tests { .. }` included), its segments as written, and
/// its line.
struct Named {
    within: Vec<String>,
    path: Vec<String>,
    line: usize,
}

/// Expands the use tree at `toks[*i..]` (after `use`), with `prefix`
/// already read, into full paths; stops after the tree.
fn use_tree(
    toks: &[(usize, String)],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) {
    let mut path = prefix;
    loop {
        let Some((_, t)) = toks.get(*i) else { return };
        match t.as_str() {
            "{" => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| t.1.as_str()) {
                        Some("}") => {
                            *i += 1;
                            return;
                        }
                        Some(",") => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            "::" => *i += 1,
            "*" => {
                *i += 1;
                out.push(path);
                return;
            }
            "as" => {
                *i += 2; // the alias
                out.push(path);
                return;
            }
            "," | "}" | ";" => {
                out.push(path);
                return;
            }
            name => {
                path.push(name.to_string());
                *i += 1;
            }
        }
    }
}

/// Every path a file names: its `use` trees, and the `crate::`,
/// `super::` and `self::` paths in its code.
fn named_paths(module: &[String], text: &str) -> Vec<Named> {
    let toks = tokens(text);
    let mut found = Vec::new();
    // The inline modules open at each brace depth: (depth, name).
    let mut inline: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let within = |inline: &[(usize, String)]| {
        let mut m = module.to_vec();
        m.extend(inline.iter().map(|(_, n)| n.clone()));
        m
    };
    while i < toks.len() {
        let (line, t) = (&toks[i].0, toks[i].1.as_str());
        match t {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                while inline.last().is_some_and(|(d, _)| *d > depth) {
                    inline.pop();
                }
            }
            "mod" if toks.get(i + 2).is_some_and(|t| t.1 == "{") => {
                inline.push((depth + 1, toks[i + 1].1.clone()));
                depth += 1;
                i += 3;
                continue;
            }
            "use" => {
                let mut paths = Vec::new();
                i += 1;
                use_tree(&toks, &mut i, Vec::new(), &mut paths);
                for path in paths {
                    found.push(Named {
                        within: within(&inline),
                        path,
                        line: *line,
                    });
                }
                continue;
            }
            "crate" | "super" | "self"
                if toks.get(i + 1).is_some_and(|t| t.1 == "::")
                    && (i == 0 || toks[i - 1].1 != "::") =>
            {
                let mut path = vec![t.to_string()];
                let mut k = i + 1;
                while toks.get(k).is_some_and(|t| t.1 == "::")
                    && toks
                        .get(k + 1)
                        .is_some_and(|t| t.1.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
                {
                    path.push(toks[k + 1].1.clone());
                    k += 2;
                }
                found.push(Named {
                    within: within(&inline),
                    path,
                    line: *line,
                });
                i = k;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The module a path names (the longest prefix that is a module of the
/// library), resolved from the module it is named in; None for other
/// crates and for paths into the module's own children by bare name.
fn resolve(
    within: &[String],
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut at: Vec<String> = match path.first()?.as_str() {
        "crate" => Vec::new(),
        "self" => within.to_vec(),
        "super" => within.to_vec(),
        _ => return None,
    };
    let mut rest = &path[1..];
    if path[0] == "super" {
        at.pop();
        while rest.first().is_some_and(|s| s == "super") {
            at.pop();
            rest = &rest[1..];
        }
    }
    for seg in rest {
        let mut next = at.clone();
        next.push(seg.clone());
        if !modules.contains(&next) {
            break;
        }
        at = next;
    }
    Some(at)
}

/// Where one module names another: (from, to, line, what was written).
struct Edge {
    from: Vec<String>,
    to: Vec<String>,
    line: usize,
    written: String,
}

fn edges(files: &[(Vec<String>, String)]) -> Vec<Edge> {
    // Every file's module and the folders above it.
    let mut modules: BTreeSet<Vec<String>> = files
        .iter()
        .flat_map(|(m, _)| (0..=m.len()).map(|k| m[..k].to_vec()))
        .collect();
    // Inline modules are modules too (tests, and `mod x { .. }` blocks).
    for (m, text) in files {
        for n in named_paths(m, text) {
            modules.insert(n.within.clone());
        }
    }
    let mut out = Vec::new();
    for (m, text) in files {
        for n in named_paths(m, text) {
            let Some(to) = resolve(&n.within, &n.path, &modules) else {
                continue;
            };
            out.push(Edge {
                from: n.within,
                to,
                line: n.line,
                written: n.path.join("::"),
            });
        }
    }
    out
}

/// The edge lifted to where the two modules part: the children of their
/// deepest common ancestor that hold each. None when one holds the other
/// (a module and its own parts, or a child using its parent).
fn lifted(from: &[String], to: &[String]) -> Option<(Vec<String>, Vec<String>)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common == from.len() || common == to.len() {
        return None;
    }
    Some((from[..=common].to_vec(), to[..=common].to_vec()))
}

/// The upward imports in `files` (module path, text), as messages.
fn upward_imports(files: &[(Vec<String>, String)]) -> Vec<String> {
    let mut bad = Vec::new();
    for (module, _) in files {
        if let Some(top) = module.first() {
            if layer_of(top).is_none() {
                bad.push(format!(
                    "{}: module `{top}` has no layer in tests/layers.rs",
                    module.join("::")
                ));
            }
        }
    }
    for e in edges(files) {
        let (Some(a), Some(b)) = (e.from.first(), e.to.first()) else {
            continue; // lib.rs: the crate root re-exports every layer
        };
        if a == b {
            continue;
        }
        let (Some(mine), Some(theirs)) = (layer_of(a), layer_of(b)) else {
            continue;
        };
        if !(theirs < mine || (theirs == 1 && mine == 1)) {
            bad.push(format!(
                "{} (line {}) uses {}, which is not below it",
                e.from.join("::"),
                e.line,
                e.written
            ));
        }
    }
    bad.sort();
    bad.dedup();
    bad
}

/// Circles between sibling modules, at any depth (e.g. comm::group ->
/// comm::queue -> comm::group, or backend::nccl::communicator ->
/// backend::nccl::watchdog -> back): each found once, as "a -> b -> a".
fn loops(files: &[(Vec<String>, String)]) -> Vec<String> {
    let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for e in edges(files) {
        if e.from.is_empty() || e.to.is_empty() {
            continue;
        }
        if let Some((a, b)) = lifted(&e.from, &e.to) {
            graph.entry(a).or_default().insert(b);
        }
    }
    // Strongly connected components (Tarjan): each with more than one
    // module is a circle.
    struct Walk<'g> {
        graph: &'g BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<Vec<String>, usize>,
        low: BTreeMap<Vec<String>, usize>,
        stack: Vec<Vec<String>>,
        on_stack: BTreeSet<Vec<String>>,
        found: Vec<Vec<Vec<String>>>,
    }
    impl Walk<'_> {
        fn visit(&mut self, v: &Vec<String>) {
            let n = self.index.len();
            self.index.insert(v.clone(), n);
            self.low.insert(v.clone(), n);
            self.stack.push(v.clone());
            self.on_stack.insert(v.clone());
            let outs: Vec<Vec<String>> = self
                .graph
                .get(v)
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            for w in outs {
                if !self.index.contains_key(&w) {
                    self.visit(&w);
                    let l = self.low[v].min(self.low[&w]);
                    self.low.insert(v.clone(), l);
                } else if self.on_stack.contains(&w) {
                    let l = self.low[v].min(self.index[&w]);
                    self.low.insert(v.clone(), l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(&w);
                    let done = &w == v;
                    scc.push(w);
                    if done {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.found.push(scc);
                }
            }
        }
    }
    let mut walk = Walk {
        graph: &graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    let mut out: Vec<String> = walk
        .found
        .into_iter()
        .map(|scc| {
            let mut names: Vec<String> = scc.iter().map(|m| m.join("::")).collect();
            names.push(names[0].clone());
            names.join(" -> ")
        })
        .collect();
    out.sort();
    out
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
fn no_modules_form_a_circle() {
    let found = loops(&library());
    assert!(
        found.is_empty(),
        "circles between modules:\n{}",
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
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("env::var") || code.contains("getenv") {
                bad.push(format!(
                    "{} line {}: {}",
                    module.join("::"),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "environment read outside options.rs:\n{}",
        bad.join("\n")
    );
}

/// The files the map in docs/architecture.md names: its tree under
/// "## The house", read by indentation (a folder line ends in `/`; an
/// entry may name several files of its folder, comma-separated, before
/// its description).
fn mapped_files() -> BTreeSet<String> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/architecture.md"))
            .unwrap();
    let house = doc
        .split("## The house")
        .nth(1)
        .and_then(|s| s.split("```").nth(1))
        .expect("docs/architecture.md has a tree under '## The house'");
    let mut out = BTreeSet::new();
    // (indent, folder) of the folders open above the current line.
    let mut open: Vec<(usize, String)> = Vec::new();
    for line in house.lines().filter(|l| !l.trim().is_empty()) {
        let indent = line.len() - line.trim_start().len();
        let first = line.split_whitespace().next().unwrap();
        // Continuation lines of a description start with a lower-case word
        // far to the right; entries start at a tree indentation (2 apart).
        if indent > open.last().map_or(0, |(i, _)| *i) + 2 {
            continue;
        }
        while open.last().is_some_and(|(i, _)| *i >= indent) {
            open.pop();
        }
        let folder: String = open.iter().map(|(_, f)| f.as_str()).collect();
        if let Some(name) = first.strip_suffix('/') {
            open.push((indent, format!("{name}/")));
            continue;
        }
        for name in line.trim().split("  ").next().unwrap().split(',') {
            let name = name.trim();
            if name.ends_with(".rs") {
                out.insert(format!("{folder}{name}"));
            }
        }
    }
    out
}

#[test]
fn the_map_names_every_file_of_src() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    fn all(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                all(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    all(&src, &mut files);
    let real: BTreeSet<String> = files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
            format!("src/{rel}")
        })
        .collect();
    let mapped = mapped_files();
    let missing: Vec<&String> = real.difference(&mapped).collect();
    let stale: Vec<&String> = mapped.difference(&real).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "docs/architecture.md's map is out of date:\n  not in the map: {missing:?}\n  in the map but not in src/: {stale:?}"
    );
}

/// The checks themselves can fail: fed an upward import, a circle made
/// of grouped imports, a circle between folders found deep inside them,
/// and a circle through `crate::` paths in code, they report each.
#[test]
fn the_checks_catch_an_upward_import_and_circles_at_any_depth() {
    let m = |s: &str| s.split("::").map(String::from).collect::<Vec<_>>();
    let files = vec![
        (
            m("transport::stream"),
            "use crate::error::Result;\nuse crate::backend::engine::Engine; // upward".to_string(),
        ),
        (m("backend::engine"), String::new()),
        (m("algorithms"), "pub mod grid;\npub mod hierarchical;".to_string()),
        (
            m("algorithms::grid"),
            "use super::{block, hierarchical::Layers, Link};\n#[cfg(test)]\nmod tests {\n    use super::*;\n}"
                .to_string(),
        ),
        (
            m("algorithms::hierarchical"),
            "use super::{\n    binomial, grid,\n    ring,\n};".to_string(),
        ),
        (m("backend::nccl"), String::new()),
        (
            m("backend::nccl::communicator"),
            "use super::watchdog::{Watchdog, Watched};".to_string(),
        ),
        (m("backend::nccl::communicator::handle"), String::new()),
        (
            m("backend::nccl::watchdog::thread"),
            "fn f() -> Option<Arc<crate::backend::nccl::communicator::handle::Raw>> { None }"
                .to_string(),
        ),
        (m("backend::nccl::watchdog"), "mod thread;".to_string()),
        (m("comm::group"), "use super::queue::Runner;".to_string()),
        (
            m("comm::queue"),
            "fn f() { let s = \"crate::comm::group\"; crate::comm::group::active(); }".to_string(),
        ),
    ];
    let bad = upward_imports(&files);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].contains("transport::stream (line 2) uses crate::backend::engine::Engine"),
        "{bad:?}"
    );
    assert_eq!(
        loops(&files),
        vec![
            "algorithms::grid -> algorithms::hierarchical -> algorithms::grid".to_string(),
            "backend::nccl::communicator -> backend::nccl::watchdog -> backend::nccl::communicator"
                .to_string(),
            "comm::group -> comm::queue -> comm::group".to_string(),
        ]
    );
}
