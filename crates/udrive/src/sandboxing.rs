//! The server's sandbox at start-up: Landlock (crate::fs_access), the launcher
//! for live upgrades, then the seccomp filters per thread role (crates/sandbox).
//! The order matters: Landlock and the filters hold for the thread that installs
//! them and the threads it starts later, so both come before the first thread;
//! the launcher must start before either, to start successors without them.

use anyhow::{Context, Result};

use crate::config::Config;

pub struct Sandboxing {
    seccomp: sandbox::Mode,
    landlock: bool,
}

impl Sandboxing {
    /// `--seccomp` / `--landlock`, else `UDRIVE_SECCOMP` / `UDRIVE_LANDLOCK`, else on.
    pub fn from_args(seccomp: Option<sandbox::Mode>, landlock: Option<&str>) -> Result<Self> {
        let env = |name: &str| std::env::var(name).ok();
        let seccomp = match (seccomp, env("UDRIVE_SECCOMP")) {
            (Some(m), _) => m,
            (None, Some(v)) => v
                .parse()
                .map_err(|e| anyhow::anyhow!("UDRIVE_SECCOMP: {e}"))?,
            (None, None) => sandbox::Mode::On,
        };
        let landlock = match landlock
            .map(str::to_owned)
            .or_else(|| env("UDRIVE_LANDLOCK"))
        {
            None => true,
            Some(v) if v == "on" => true,
            Some(v) if v == "off" => false,
            Some(v) => anyhow::bail!("UDRIVE_LANDLOCK={v}: expected on or off"),
        };
        Ok(Self { seccomp, landlock })
    }

    /// Sandboxes this process for serving `cfg`. `--supervise`'s supervisor never
    /// calls this: it reads only its child's records and starts each new child
    /// unfiltered.
    pub fn enter(&self, cfg: &Config) -> Result<()> {
        let under_manager = crate::handover::successor::under_service_manager();
        if self.seccomp != sandbox::Mode::Off && under_manager {
            crate::handover::launcher::start()?;
        }
        if self.landlock {
            let rules = crate::fs_access::rules(cfg, &cfg.allow_dirs);
            crate::fs_access::restrict(rules, cfg.allow_dirs.clone())?;
        }
        sandbox::configure(self.seccomp)
            .context("cannot set up the seccomp sandbox (--seccomp off runs without)")?;
        if self.seccomp != sandbox::Mode::Off {
            tracing::info!(mode = %self.seccomp, "seccomp filters per thread role");
        }
        Ok(())
    }
}
