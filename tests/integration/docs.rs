//! The book under docs/ and README.md: every `{{#include}}` names a file
//! and anchor that exist (mdbook itself only warns, or includes nothing,
//! when they do not), README.md stays short and its links resolve.

use std::path::{Path, PathBuf};

use crate::common::repo_root;

/// `(target, anchor)` of every `{{#include target[:anchor]}}` in `text`.
fn includes(text: &str) -> Vec<(String, Option<String>)> {
    text.match_indices("{{#include ")
        .map(|(i, m)| {
            let rest = &text[i + m.len()..];
            let spec = rest[..rest.find("}}").expect("an include is closed with }}")].trim();
            match spec.split_once(':') {
                Some((path, anchor)) => (path.to_string(), Some(anchor.to_string())),
                None => (spec.to_string(), None),
            }
        })
        .collect()
}

fn book_pages() -> Vec<PathBuf> {
    let dir = repo_root().join("docs/src");
    let mut pages: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    pages
}

#[test]
fn every_book_include_names_an_existing_file_and_anchor() {
    let mut checked = 0;
    for page in book_pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (target, anchor) in includes(&text) {
            let file = page.parent().unwrap().join(&target);
            let source = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: includes {target}: {e}", page.display()));
            if let Some(anchor) = anchor {
                let (start, end) = (format!("ANCHOR: {anchor}"), format!("ANCHOR_END: {anchor}"));
                let from = source.find(&start).unwrap_or_else(|| panic!("{}: {target} has no `{start}`", page.display()));
                let to = source.find(&end).unwrap_or_else(|| panic!("{}: {target} has no `{end}`", page.display()));
                let body = &source[from + start.len()..to];
                assert!(body.lines().filter(|l| !l.trim().is_empty()).count() > 1, "{}: anchor {anchor} of {target} is empty", page.display());
            }
            checked += 1;
        }
    }
    // The contract, the FGD table, the Rust template and binpack, and the
    // three other languages' templates.
    assert!(checked >= 7, "{checked} includes found");
}

/// Chapters named in SUMMARY.md (mdbook fails the build when one is
/// missing: `create-missing = false`).
fn summary_chapters() -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("docs/src/SUMMARY.md")).unwrap();
    text.match_indices("](").map(|(i, _)| text[i + 2..].split(')').next().unwrap().to_string()).collect()
}

#[test]
fn readme_is_short_and_links_into_the_book() {
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(readme.len() < 12 * 1024, "README.md is {} bytes; the manual belongs in docs/", readme.len());
    let chapters = summary_chapters();
    let mut into_book = 0;
    for (i, _) in readme.match_indices("](") {
        let target = readme[i + 2..].split(')').next().unwrap();
        if target.starts_with("http") || target.starts_with('#') {
            continue;
        }
        let path = target.split('#').next().unwrap();
        let in_summary = path.strip_prefix("docs/src/").is_some_and(|p| chapters.iter().any(|c| c == p));
        assert!(root.join(path).exists() || in_summary, "README.md links to {target}, which does not exist");
        if path.starts_with("docs/src/") {
            assert!(in_summary || Path::new(path).ends_with("SUMMARY.md"), "README.md links to {path}, not a chapter of the book");
            into_book += 1;
        }
    }
    assert!(into_book >= 10, "README.md links to {into_book} chapters");
}

/// The host side (`serve/`) and the node agent (`agent/`) share only the
/// generated protocol (`proto`) and small helpers (`util`), never each
/// other's modules: no file cycle between them.
#[test]
fn serve_and_agent_do_not_import_each_other() {
    let src = crate::common::repo_root().join("host/src");
    for (dir, forbidden) in [("agent", ["crate::serve", "super::super::serve"]), ("serve", ["crate::agent", "super::super::agent"])] {
        let mut files = 0;
        for entry in std::fs::read_dir(src.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                files += 1;
                let text = std::fs::read_to_string(&path).unwrap();
                for f in forbidden {
                    assert!(!text.contains(f), "{} uses {f}", path.display());
                }
            }
        }
        assert!(files > 2, "host/src/{dir} has its modules");
    }
}
