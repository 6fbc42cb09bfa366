//! `udrive generate`: man pages and shell completions from the command-line
//! definitions, so that they cannot drift from `--help`. Hidden from `--help`: a
//! packaging step, not an operator's command (docs/operators.md).

use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Write udrive.1 and one page per command (udrive-serve.1, ...) into DIR
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
    /// Print the completion script for SHELL on stdout
    Completions {
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
}

/// Generates `a.what` for the command line `cmd` (the binary's, with every
/// subcommand).
pub fn run(a: GenerateArgs, cmd: clap::Command) -> Result<()> {
    match a.what {
        What::Man { dir } => {
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(cmd, &dir)
                .with_context(|| format!("cannot write man pages into {}", dir.display()))
        }
        What::Completions { shell } => {
            let mut cmd = cmd;
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut cmd, "udrive", &mut out);
            crate::stdout::write(format_args!("{}", String::from_utf8_lossy(&out)))?;
            Ok(())
        }
    }
}
