//! The house map, read from the sources: which file of the host library and
//! of the core uses which. Files form layers, so a reader can start at the
//! bottom (the core's `units`, serve's `state`) and never meet a file that
//! needs one above it: no file cycle.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every `.rs` file under `root`, by module path (`serve/mod.rs` is `serve`).
fn modules(root: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).unwrap().with_extension("");
                let mut m: Module = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
                if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    m.pop();
                }
                if m.is_empty() && path.ends_with("main.rs") {
                    continue; // the binary is not part of the library
                }
                out.insert(m, path);
            }
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path, // ::
    Punct(char),
}

/// Identifiers, `::` and punctuation, with comments, strings and character
/// literals left out (a `'{'` must not count as a brace).
fn tokens(text: &str) -> Vec<Tok> {
    let b: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == '/' && b.get(i + 1) == Some(&'/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && b.get(i + 1) == Some(&'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == 'r' && (b.get(i + 1) == Some(&'#') || b.get(i + 1) == Some(&'"')) && !out.last().is_some_and(|t| matches!(t, Tok::Ident(_))) {
            // raw string r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(Tok::Ident("r".into()));
                i += 1;
                continue;
            }
            j += 1;
            while j < b.len() && !(b[j] == '"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&'#'))) {
                j += 1;
            }
            i = j + 1 + hashes;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c == '\'' {
            // a character literal ('x', '\n', '\u{..}'), or a lifetime
            if b.get(i + 1) == Some(&'\\') {
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
            out.push(Tok::Ident(b[start..i].iter().collect()));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push(Tok::Path);
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(Tok::Punct(c));
            }
            i += 1;
        }
    }
    out
}

/// A path a file names, and the inline modules (`mod x { .. }`) it is in.
struct Named {
    path: Vec<String>,
    inline_depth: usize,
    public_use: bool,
}

/// Expands the use tree at `toks[*i]` into full paths.
fn use_tree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
                if toks.get(*i) == Some(&Tok::Ident("as".into())) {
                    *i += 2;
                }
            }
            Some(Tok::Punct('*')) => *i += 1,
            Some(Tok::Punct('{')) => {
                *i += 1;
                while toks.get(*i).is_some_and(|t| *t != Tok::Punct('}')) {
                    use_tree(toks, i, &path, out);
                    if toks.get(*i) == Some(&Tok::Punct(',')) {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            _ => {}
        }
        if toks.get(*i) == Some(&Tok::Path) {
            *i += 1;
        } else {
            out.push(path);
            return;
        }
    }
}

/// Every path a file names through `use` and in its code, outside its
/// `#[cfg(test)]` modules.
fn named_paths(text: &str) -> Vec<Named> {
    let toks = tokens(text);
    let ident = |i: usize, s: &str| matches!(toks.get(i), Some(Tok::Ident(t)) if t == s);
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut inline: Vec<usize> = Vec::new(); // brace depth at which each inline module opened
    let mut i = 0;
    while i < toks.len() {
        // #[cfg(test)] mod x { .. }: skipped whole
        if toks[i] == Tok::Punct('#') && ident(i + 2, "cfg") && ident(i + 4, "test") && ident(i + 7, "mod") && toks.get(i + 9) == Some(&Tok::Punct('{')) {
            let mut d = 0;
            i += 9;
            loop {
                match toks[i] {
                    Tok::Punct('{') => d += 1,
                    Tok::Punct('}') => {
                        d -= 1;
                        if d == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            i += 1;
            continue;
        }
        match &toks[i] {
            Tok::Punct('{') => {
                if i >= 2 && ident(i - 2, "mod") {
                    inline.push(depth);
                }
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                depth -= 1;
                if inline.last() == Some(&depth) {
                    inline.pop();
                }
                i += 1;
            }
            Tok::Ident(s) if s == "use" && !(i > 0 && toks[i - 1] == Tok::Path) => {
                let public_use = i > 0 && (ident(i - 1, "pub") || toks[i - 1] == Tok::Punct(')'));
                i += 1;
                let mut paths = Vec::new();
                use_tree(&toks, &mut i, &[], &mut paths);
                out.extend(paths.into_iter().map(|path| Named { path, inline_depth: inline.len(), public_use }));
            }
            Tok::Ident(s) if toks.get(i + 1) == Some(&Tok::Path) && !(i > 0 && toks[i - 1] == Tok::Path) => {
                let mut path = vec![s.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(t)) => path.push(t.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                out.push(Named { path, inline_depth: inline.len(), public_use: false });
                i = j;
            }
            _ => i += 1,
        }
    }
    out
}

/// The file a path leads to, from file `from`; `None` outside the crate.
fn resolve(from: &Module, named: &Named, crate_name: &str, mods: &BTreeMap<Module, PathBuf>, reexports: &BTreeMap<(Module, String), Module>) -> Option<Module> {
    let segs = &named.path;
    let (mut at, rest): (Module, &[String]) = match segs.first()?.as_str() {
        "crate" => (Vec::new(), &segs[1..]),
        s if s == crate_name => (Vec::new(), &segs[1..]),
        "self" => (from.clone(), &segs[1..]),
        "super" => {
            let mut at = from.clone();
            let mut inline = named.inline_depth;
            let mut k = 0;
            while segs.get(k).is_some_and(|s| s == "super") {
                if inline > 0 {
                    inline -= 1;
                } else {
                    at.pop();
                }
                k += 1;
            }
            (at, &segs[k..])
        }
        first => {
            let mut child = from.clone();
            child.push(first.to_string());
            if named.inline_depth > 0 || !mods.contains_key(&child) {
                return None;
            }
            (from.clone(), segs)
        }
    };
    for s in rest {
        let mut next = at.clone();
        next.push(s.clone());
        if mods.contains_key(&next) {
            at = next;
        } else {
            if let Some(target) = reexports.get(&(at.clone(), s.clone())) {
                return Some(target.clone());
            }
            break;
        }
    }
    Some(at)
}

/// The file-level dependency graph of one crate: edge (a, b) with the path
/// that made it.
fn graph(root: &Path, crate_name: &str) -> (BTreeMap<Module, PathBuf>, BTreeMap<Module, BTreeMap<Module, String>>) {
    let mods = modules(root);
    let named: BTreeMap<Module, Vec<Named>> = mods.iter().map(|(m, p)| (m.clone(), named_paths(&std::fs::read_to_string(p).unwrap()))).collect();
    // Re-exports first (twice, for a re-export of a re-export): a name used
    // through a parent's `pub use` leads to the file that defines it.
    let mut reexports = BTreeMap::new();
    for _ in 0..2 {
        for (m, ns) in &named {
            for n in ns.iter().filter(|n| n.public_use) {
                if let Some(target) = resolve(m, n, crate_name, &mods, &reexports) {
                    if &target != m {
                        reexports.insert((m.clone(), n.path.last().unwrap().clone()), target);
                    }
                }
            }
        }
    }
    let mut edges: BTreeMap<Module, BTreeMap<Module, String>> = BTreeMap::new();
    for (m, ns) in &named {
        for n in ns {
            if let Some(target) = resolve(m, n, crate_name, &mods, &reexports) {
                if &target != m {
                    edges.entry(m.clone()).or_default().entry(target).or_insert_with(|| n.path.join("::"));
                }
            }
        }
    }
    (mods, edges)
}

/// A cycle through the graph, as "a -> b (via path)" steps, if there is one.
fn find_cycle(mods: &BTreeMap<Module, PathBuf>, edges: &BTreeMap<Module, BTreeMap<Module, String>>) -> Option<Vec<String>> {
    fn visit<'a>(m: &'a Module, edges: &'a BTreeMap<Module, BTreeMap<Module, String>>, state: &mut BTreeMap<&'a Module, u8>, stack: &mut Vec<&'a Module>) -> Option<Vec<String>> {
        state.insert(m, 1);
        stack.push(m);
        for next in edges.get(m).into_iter().flat_map(BTreeMap::keys) {
            match state.get(next).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|s| *s == next).unwrap();
                    let mut ring: Vec<&Module> = stack[from..].to_vec();
                    ring.push(next);
                    let name = |m: &Module| if m.is_empty() { "lib".to_string() } else { m.join("/") };
                    return Some(ring.windows(2).map(|w| format!("{} -> {} (via {})", name(w[0]), name(w[1]), edges[w[0]][w[1]])).collect());
                }
                0 => {
                    if let Some(c) = visit(next, edges, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(m, 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in mods.keys() {
        if state.get(m).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(m, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn the_host_library_and_the_core_have_no_file_cycle() {
    let root = crate::common::repo_root();
    for (dir, crate_name, at_least) in [("host/src", "crate", 60), ("host/core/src", "berth_core", 15)] {
        let (mods, edges) = graph(&root.join(dir), crate_name);
        assert!(mods.len() >= at_least, "{dir}: {} files found", mods.len());
        let edge_count: usize = edges.values().map(BTreeMap::len).sum();
        assert!(edge_count > mods.len(), "{dir}: only {edge_count} uses between {} files were read", mods.len());
        if let Some(cycle) = find_cycle(&mods, &edges) {
            panic!("{dir} has a file cycle:\n  {}", cycle.join("\n  "));
        }
    }
}

/// The reader finds cycles: one made on purpose is reported with the paths
/// that close it.
#[test]
fn the_file_cycle_check_sees_a_cycle() {
    let dir = crate::common::repo_root().join("target/tmp/layout-cycle");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("a")).unwrap();
    std::fs::write(dir.join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(dir.join("a/mod.rs"), "pub mod inner;\nuse crate::b::Thing;\n/// '{' is no brace\nconst C: char = '{';\n").unwrap();
    std::fs::write(dir.join("a/inner.rs"), "mod local { use super::super::Other; }\n#[cfg(test)]\nmod tests { use crate::b::Thing; }\n").unwrap();
    std::fs::write(dir.join("b.rs"), "pub struct Thing;\nfn f() { let _ = crate::a::inner::g(); }\n").unwrap();
    let (mods, edges) = graph(&dir, "crate");
    assert_eq!(mods.len(), 4);
    let cycle = find_cycle(&mods, &edges).expect("a -> b -> a/inner -> a is a cycle");
    let text = cycle.join(" ");
    assert!(text.contains("via crate::b::Thing") && text.contains("via crate::a::inner::g"), "{text}");
    // `super::super` from an inline module of a/inner is a/inner's parent, `a`.
    assert!(edges[&vec!["a".to_string(), "inner".to_string()]].contains_key(&vec!["a".to_string()]), "{edges:?}");
    // A test module's uses are not edges.
    assert!(!edges[&vec!["a".to_string(), "inner".to_string()]].contains_key(&vec!["b".to_string()]));
}
