//! A suite: several matrices (presets, or matrix files beside the suite's file) run
//! one after another, each into its own directory under `--out`, then an index.html
//! linking their reports and a summary.md joining theirs. Preset `readme` is one:
//! what README's table and docs/benchmarks.md cite, in one command.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use super::matrix::{self, Matrix};
use super::BenchArgs;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    #[serde(default)]
    pub description: String,
    /// Preset names, or matrix files (relative to the suite's file).
    pub suite: Vec<String>,
}

/// The suite in `text`, if it is one (it has a top-level `suite`).
pub fn parse(text: &str) -> Result<Option<Suite>> {
    let table: toml::Table = toml::from_str(text).context("not TOML")?;
    if !table.contains_key("suite") {
        return Ok(None);
    }
    let s: Suite = toml::from_str(text).context("a suite: description and suite only")?;
    if s.suite.is_empty() {
        bail!("suite: name at least one preset or matrix file");
    }
    Ok(Some(s))
}

/// One member: its name (the directory of its results) and its matrix text.
struct Member {
    name: String,
    text: String,
    description: String,
    /// The matrix file, for a member that is one.
    file: Option<PathBuf>,
}

/// Every member read and checked before anything runs.
fn members(s: &Suite, base: &Path) -> Result<Vec<Member>> {
    let mut out: Vec<Member> = Vec::new();
    for (i, m) in s.suite.iter().enumerate() {
        let (text, file) = match matrix::preset(m) {
            Some(t) => (t.to_string(), None),
            None => {
                let f = base.join(m);
                let t = std::fs::read_to_string(&f).with_context(|| {
                    format!("suite[{i}]: `{m}` is neither a preset nor a readable matrix file")
                })?;
                (t, Some(f))
            }
        };
        if parse(&text)?.is_some() {
            bail!("suite[{i}]: `{m}` is a suite itself; list its members instead");
        }
        let description = Matrix::parse(&text)
            .with_context(|| format!("suite[{i}]: `{m}`"))?
            .description;
        let name = Path::new(m)
            .file_stem()
            .map_or_else(|| m.clone(), |s| s.to_string_lossy().into_owned());
        if out.iter().any(|o| o.name == name) {
            bail!("suite[{i}]: `{name}` twice: its results would overwrite each other");
        }
        out.push(Member {
            name,
            text,
            description,
            file,
        });
    }
    Ok(out)
}

/// Runs every member with the command line's overrides, each into `out/NAME`; a
/// member that fails does not stop the others.
pub fn run(a: &BenchArgs, s: &Suite, base: &Path) -> Result<()> {
    let members = members(s, base)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut failed = Vec::new();
    let n = members.len();
    for (k, m) in members.iter().enumerate() {
        eprintln!("udrive bench: suite {}/{n}: {} ...", k + 1, m.name);
        let mut sub = a.clone();
        sub.out = a.out.join(&m.name);
        (sub.preset, sub.matrix) = match &m.file {
            Some(f) => (None, Some(f.clone())),
            None => (Some(m.name.clone()), None),
        };
        if let Err(e) = super::run_matrix(&sub, &m.text) {
            eprintln!("udrive bench: {}: {e:#}", m.name);
            failed.push(m.name.as_str());
        }
        if super::stopped() {
            write_index(&a.out, s, &members)?;
            bail!(
                "interrupted; the matrices so far are in {}",
                a.out.display()
            );
        }
    }
    write_index(&a.out, s, &members)?;
    eprintln!(
        "udrive bench: index in {}",
        a.out.join("index.html").display()
    );
    if !failed.is_empty() {
        bail!(
            "{} of {n} matrices had failures: {} (see their summary.md)",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// index.html (a link per member's report) and summary.md (theirs, one after another).
fn write_index(out: &Path, s: &Suite, members: &[Member]) -> Result<()> {
    let esc = |t: &str| {
        t.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let mut html = String::from(
        "<!doctype html><meta charset=\"utf-8\"><title>udrive bench</title>\
         <style>body{font-family:sans-serif;max-width:60em;margin:2em auto}</style>",
    );
    let _ = write!(
        html,
        "<h1>udrive bench</h1><p>{}</p><ul>",
        esc(&s.description)
    );
    let mut md = format!("# udrive bench\n\n{}\n\n", s.description);
    for m in members {
        let dir = out.join(&m.name);
        let has_report = dir.join("report.html").is_file();
        let link = if has_report {
            format!("<a href=\"{0}/report.html\">{0}</a>", esc(&m.name))
        } else {
            format!("{} (no report)", esc(&m.name))
        };
        let _ = write!(html, "<li>{link}: {}</li>", esc(&m.description));
        let summary = std::fs::read_to_string(dir.join("summary.md"))
            .unwrap_or_else(|_| "(no summary: the matrix did not run)\n".into());
        // Each member's headings one level down, under its name.
        let _ = writeln!(md, "# {}\n", m.name);
        for line in summary.lines().skip_while(|l| l.starts_with("# ")) {
            if line.starts_with('#') {
                md.push('#');
            }
            md.push_str(line);
            md.push('\n');
        }
    }
    html.push_str("</ul>");
    for (f, t) in [("index.html", html), ("summary.md", md)] {
        std::fs::write(out.join(f), t).with_context(|| format!("writing {f}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_suite_preset_names_presets_that_parse() {
        let mut suites = 0;
        for (name, text) in matrix::PRESETS {
            if let Some(s) = parse(text).unwrap() {
                let m = members(&s, Path::new("")).unwrap_or_else(|e| panic!("{name}: {e:#}"));
                assert!(m.iter().all(|m| m.file.is_none()), "{name}");
                suites += 1;
            }
        }
        assert!(suites >= 1);
        assert!(parse("reps = 2").unwrap().is_none());
        assert!(parse("suite = []").is_err());
        assert!(
            parse("suite = [\"quick\"]\nreps = 2").is_err(),
            "a suite is not a matrix"
        );
    }
}
