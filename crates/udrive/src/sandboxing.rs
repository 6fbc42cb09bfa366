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
    user: Option<(String, Option<String>)>,
}

impl Sandboxing {
    /// `--seccomp` / `--landlock`, else `UDRIVE_SECCOMP` / `UDRIVE_LANDLOCK`, else
    /// on; `--user`, `--group`.
    pub fn from_args(args: &crate::serve::ServeArgs) -> Result<Self> {
        let env = |name: &str| std::env::var(name).ok();
        let seccomp = match (args.seccomp, env("UDRIVE_SECCOMP")) {
            (Some(m), _) => m,
            (None, Some(v)) => v
                .parse()
                .map_err(|e| anyhow::anyhow!("UDRIVE_SECCOMP: {e}"))?,
            (None, None) => sandbox::Mode::On,
        };
        let landlock = match args.landlock.clone().or_else(|| env("UDRIVE_LANDLOCK")) {
            None => true,
            Some(v) if v == "on" => true,
            Some(v) if v == "off" => false,
            Some(v) => anyhow::bail!("UDRIVE_LANDLOCK={v}: expected on or off"),
        };
        let user = args.user.clone().map(|u| (u, args.group.clone()));
        Ok(Self {
            seccomp,
            landlock,
            user,
        })
    }

    /// Sandboxes this process for serving `cfg`. `--supervise`'s supervisor never
    /// calls this: it reads only its child's records and starts each new child
    /// unfiltered.
    pub fn enter(&self, cfg: &Config) -> Result<()> {
        if let Some((user, group)) = &self.user {
            let id = sandbox::become_user(user, group.as_deref())
                .with_context(|| format!("cannot become user {user}"))?;
            tracing::info!(uid = id.uid, gid = id.gid, "running as user {user}");
        }
        // Guests' memory and volume keys are mapped from here on.
        sandbox::no_core_dumps().context("cannot turn core dumps off")?;
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
