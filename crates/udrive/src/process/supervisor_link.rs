//! A supervised child's channel to its supervisor (its standard input): what the
//! supervisor kept from the previous child at start, and a [`Keeper`] that sends
//! it new records as devices change state.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context, Result};
use lifecycle::channel::{self, Op};
use lifecycle::{Keeper, Kept, KeptRecords};

pub(super) struct SupervisorLink {
    sock: OwnedFd,
    /// One warning when the supervisor is gone, not one per record.
    warned: AtomicBool,
}

impl SupervisorLink {
    /// Connects to the supervisor and takes the records it kept.
    pub fn attach() -> Result<(SupervisorLink, KeptRecords)> {
        let sock = std::io::stdin()
            .as_fd()
            .try_clone_to_owned()
            .context("supervise: cannot take the supervisor's channel")?;
        channel::send(sock.as_fd(), Op::Hello, "", &[], &[]).context(
            "--supervised: standard input is not a supervisor's channel (run `udrive serve --supervise`)",
        )?;
        let mut buf = vec![0u8; channel::MAX_MSG];
        let mut got = KeptRecords::new();
        loop {
            let Some(m) =
                channel::recv(sock.as_fd(), &mut buf).context("supervise: reading kept records")?
            else {
                bail!("supervise: the supervisor closed the channel");
            };
            match m.op {
                Op::Record => {
                    got.insert(
                        m.key,
                        Kept {
                            bytes: m.bytes,
                            fds: m.fds,
                        },
                    );
                }
                Op::End => break,
                op => bail!("supervise: unexpected {op:?} from the supervisor"),
            }
        }
        if !got.is_empty() {
            tracing::info!(
                records = got.len(),
                "supervise: took over what the previous process kept"
            );
        }
        let link = SupervisorLink {
            sock,
            warned: AtomicBool::new(false),
        };
        Ok((link, got))
    }

    fn send(&self, op: Op, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        if let Err(e) = channel::send(self.sock.as_fd(), op, key, bytes, fds) {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "supervise: cannot reach the supervisor ({e}); clients will not \
                     survive a crash of this process"
                );
            }
        }
    }

    /// Devices are up: the supervisor drops the records no device took and the
    /// notes this child has read (keys relative to the note prefix), and restarts
    /// this child if it dies from now on.
    pub fn ready<'a>(
        &self,
        untaken: impl Iterator<Item = &'a String>,
        notes: impl Iterator<Item = &'a String>,
    ) {
        for key in untaken {
            self.remove(key);
        }
        for key in notes {
            self.remove(&format!("{}{key}", super::NOTE_PREFIX));
        }
        self.send(Op::Ready, "", &[], &[]);
    }
}

impl Keeper for SupervisorLink {
    fn put(&self, key: &str, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        self.send(Op::Put, key, bytes, fds);
    }
    fn remove(&self, prefix: &str) {
        self.send(Op::Remove, prefix, &[], &[]);
    }
}
