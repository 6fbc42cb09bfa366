//! Rules of the code base that the compiler does not hold, checked over every
//! crate of the workspace: no source file over 800 lines, and no import circle of
//! more than two files inside a crate (a module that names another through
//! `crate::`, `super::` or a child path depends on it; a circle of three or more
//! files is a knot no layer can be lifted out of). Functions over 100 lines are
//! clippy's `too_many_lines` (clippy.toml).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_FILE_LINES: usize = 800;

type Module = Vec<String>;

fn workspace() -> PathBuf {
    let w = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    w.canonicalize().unwrap_or(w)
}

/// `p` relative to the workspace, for messages.
fn shown(p: &Path) -> String {
    let w = workspace();
    p.strip_prefix(&w).unwrap_or(p).display().to_string()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn crate_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    v.sort();
    v
}

#[test]
fn no_source_file_is_over_800_lines() {
    let mut files = Vec::new();
    for c in crate_dirs() {
        rust_files(&c, &mut files);
    }
    rust_files(&workspace().join("fuzz"), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).ok()?.lines().count();
            (n > MAX_FILE_LINES).then(|| format!("{} ({n} lines)", shown(f)))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines: {long:#?}"
    );
}

/// The module a file of `src/` is: `a/b.rs` and `a/b/mod.rs` are `a::b`.
fn module_of(src: &Path, file: &Path) -> (Module, bool) {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let dir_module = matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    );
    if dir_module {
        parts.pop();
    }
    (parts, dir_module)
}

/// Source without comments and without its `#[cfg(test)] mod tests`.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `a::b::c` path that starts with `head` (`crate`, `super`) in `code`,
/// including the items of a `head::{x, y::z}` group.
fn paths(code: &str, head: &str) -> Vec<Module> {
    let mut out = Vec::new();
    let pat = format!("{head}::");
    let mut rest = code;
    while let Some(i) = rest.find(&pat) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + pat.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let item = item.split(" as ").next().unwrap_or("").trim();
                let item = item.split('{').next().unwrap_or("").trim_end_matches("::");
                if !item.is_empty() {
                    out.push(item.split("::").map(str::to_string).collect());
                }
            }
            continue;
        }
        let path: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        out.push(
            path.split("::")
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        );
    }
    out
}

/// The longest prefix of `path` that is a module of `mods`.
fn resolve(mods: &BTreeSet<Module>, path: &[String]) -> Option<Module> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| mods.contains(m))
}

fn import_graph(src: &Path) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mods: BTreeSet<Module> = files.iter().map(|f| module_of(src, f).0).collect();
    let mut graph = BTreeMap::new();
    for f in &files {
        let (m, dir_module) = module_of(src, f);
        let code = code(&std::fs::read_to_string(f).unwrap_or_default());
        let parent: Module = m[..m.len().saturating_sub(1)].to_vec();
        let mut deps = BTreeSet::new();
        for p in paths(&code, "crate") {
            deps.extend(resolve(&mods, &p));
        }
        for p in paths(&code, "super") {
            let mut full = parent.clone();
            full.extend(p);
            deps.extend(resolve(&mods, &full));
        }
        if dir_module {
            // A parent naming a child module (`child::item`, `pub use child::x`).
            for child in mods
                .iter()
                .filter(|c| c.len() == m.len() + 1 && c.starts_with(&m))
            {
                let name = format!("{}::", child[m.len()]);
                let named = code.match_indices(&name).any(|(i, _)| {
                    !code[..i]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
                });
                if named {
                    deps.insert(child.clone());
                }
            }
        }
        deps.remove(&m);
        deps.remove(&Vec::new());
        graph.insert(m, deps);
    }
    graph
}

/// Strongly connected components (Tarjan), larger than one module.
fn circles(g: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct T<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a Module) {
        let i = t.index.len();
        t.index.insert(v, i);
        t.low.insert(v, i);
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut c = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                c.push(w.clone());
                if w == v {
                    break;
                }
            }
            if c.len() > 1 {
                t.out.push(c);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

#[test]
fn no_import_circle_spans_more_than_two_files() {
    let mut knots = Vec::new();
    for c in crate_dirs() {
        let src = c.join("src");
        for circle in circles(&import_graph(&src)) {
            if circle.len() > 2 {
                let names: Vec<String> = circle.iter().map(|m| m.join("::")).collect();
                knots.push(format!("{}: {}", shown(&c), names.join(", ")));
            }
        }
    }
    assert!(
        knots.is_empty(),
        "import circles of more than two files: {knots:#?}"
    );
}

#[test]
fn the_circle_finder_finds_a_circle_of_three() {
    let m = |s: &str| -> Module { s.split("::").map(str::to_string).collect() };
    let mut g = BTreeMap::new();
    g.insert(m("a"), BTreeSet::from([m("b")]));
    g.insert(m("b"), BTreeSet::from([m("c")]));
    g.insert(m("c"), BTreeSet::from([m("a")]));
    g.insert(m("d"), BTreeSet::from([m("a")]));
    let c = circles(&g);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].len(), 3);
    let code = "use crate::{x::y, z as w};\nfn f() { super::q::r(); }";
    assert_eq!(paths(code, "crate"), vec![m("x::y"), m("z")]);
    assert_eq!(paths(code, "super"), vec![m("q::r")]);
}
