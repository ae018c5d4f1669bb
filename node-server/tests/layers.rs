//! The crate's layering, read from its sources: which top-level module's code (tests
//! excluded) names which other through `crate::`. No two modules may name each other,
//! `backend` knows no model type, `store` no tiers, and only the command line reaches the
//! dev tools. Also: no source file over 800 lines outside tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path.display().to_string(), text));
        }
    }
}

/// Each source's text before its `#[cfg(test)]` module (tests may reach anywhere).
fn product_sources() -> Vec<(String, String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    files
        .into_iter()
        .map(|(path, text)| {
            let rel = path[root.display().to_string().len() + 1..].to_string();
            let top = rel
                .split('/')
                .next()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            let product = text.split("#[cfg(test)]").next().unwrap().to_string();
            (rel, top, product)
        })
        .collect()
}

fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (_, top, text) in product_sources() {
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() && name != top {
                edges.entry(top.clone()).or_default().insert(name);
            }
        }
    }
    edges
}

#[test]
fn no_two_modules_import_each_other() {
    let edges = imports();
    for (from, tos) in &edges {
        for to in tos {
            assert!(
                !edges.get(to).is_some_and(|back| back.contains(from)),
                "{from} and {to} import each other: {edges:?}"
            );
        }
    }
}

#[test]
fn lower_layers_stay_below() {
    let edges = imports();
    let reaches = |from: &str, to: &str| edges.get(from).is_some_and(|t| t.contains(to));
    for lower in ["backend", "quant"] {
        for upper in ["model", "tiers", "store", "engine", "api"] {
            assert!(!reaches(lower, upper), "{lower} imports {upper}");
        }
    }
    assert!(!reaches("store", "tiers"), "store imports tiers");
    assert!(!reaches("model", "tiers"), "model imports tiers");
    for (from, tos) in &edges {
        if tos.contains("tools") {
            assert_eq!(from, "cli", "only the command line reaches the dev tools");
        }
    }
}

#[test]
fn no_source_file_over_800_lines() {
    let long: Vec<(String, usize)> = product_sources()
        .into_iter()
        .map(|(rel, _, text)| (rel, text.lines().count()))
        .filter(|(_, n)| *n > 800)
        .collect();
    assert!(long.is_empty(), "over 800 lines (tests excluded): {long:?}");
}
