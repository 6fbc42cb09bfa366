//! Format NVM (NVMe 1.4 §5.23; NVMe 2.0 adds LBAFU): a namespace changes between
//! the LBA formats Identify Namespace lists (512- and 4096-byte blocks, no
//! metadata) and is erased. docs/decisions/0011-nvme-conformance.md says why each
//! refusal has the status it has.
//!
//! A format runs in three steps, so no I/O races it and no thread that serves
//! other controllers waits for it:
//!
//! 1. On the control path (`Inner::format_nvm`): the command is checked; every
//!    queue group is taken off its reactor at once; if one has requests in flight
//!    on a target namespace the command ends with Command Sequence Error (§5.23
//!    allows it), otherwise each group marks the namespace *formatting* (new I/O
//!    gets Format In Progress) and the groups go back. The command stays
//!    outstanding, like an Asynchronous Event Request.
//! 2. On an `nvme-format` thread: Write Zeroes over the whole backend in
//!    [`ERASE_CHUNK`] requests, then a Flush, through a channel of its own. The
//!    controller's lock is not held.
//! 3. Back on the control path (`Inner::finish_format`): the namespaces take their
//!    new facts through the same `NsChange` path as hot-add/remove, the completion
//!    is queued for the admin CQ and a Namespace Attribute Changed event is sent.
//!
//! Removing a namespace or stopping the controller cancels the erase and waits (at
//! most [`CANCEL_WAIT`]) for the request at the backend, so no zeroes land after
//! the backend was handed to someone else.

// Guest and client numbers are parsed here: no silent truncation.
#![deny(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss
)]

use std::sync::{Arc, Weak};
use std::time::Duration;

use bdev::{BlockDevice, BlockInfo, FormatSupport, IoChannel, IoOp, IoRequest, IoStatus};

use super::format_job::{FormatRun, Job};
use super::{err, ok, Done};
use crate::ctrl::{Inner, State};
use crate::identify::lba_formats;
use crate::io::NsChange;
use crate::ns::Ns;
use crate::queue::Sqe;
use crate::status::{Nvme, Status};

pub(crate) const FORMAT_NVM: u8 = 0x80;

/// NSID FFFFFFFFh: every active namespace (FNA bit 0 is clear).
const NSID_ALL: u32 = 0xffff_ffff;

/// Bytes one erase request covers. Between two of them a cancel can stop the erase;
/// each is one `fallocate` for files (or 64 MiB of written zeroes where the
/// filesystem cannot zero a range) and one `madvise` for memory.
pub(crate) const ERASE_CHUNK: u64 = 64 << 20;

/// Secure Erase Settings: 1 = User Data Erase. 0 (none) erases too (see
/// `Inner::format_nvm`); 2 (cryptographic erase) is not supported (FNA bit 2 = 0).
const SES_USER_DATA: u8 = 1;

/// The fields of Format NVM's CDW10.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FormatCmd {
    /// LBA format index: LBAF (bits 3:0) plus LBAFU (bits 13:12, NVMe 2.0) above it.
    pub lbaf: usize,
    /// Metadata Settings (bit 4): where metadata goes. No format has metadata, so it
    /// changes nothing and is accepted either way.
    pub mset: bool,
    /// Protection Information (bits 7:5).
    pub pi: u8,
    /// Protection Information Location (bit 8): meaningless without PI, ignored.
    pub pil: bool,
    /// Secure Erase Settings (bits 11:9).
    pub ses: u8,
}

impl FormatCmd {
    pub fn parse(cdw10: u32) -> FormatCmd {
        FormatCmd {
            lbaf: ((cdw10 & 0xf) | ((cdw10 >> 12) & 0x3) << 4) as usize,
            mset: cdw10 & (1 << 4) != 0,
            pi: ((cdw10 >> 5) & 0x7) as u8,
            pil: cdw10 & (1 << 8) != 0,
            ses: ((cdw10 >> 9) & 0x7) as u8,
        }
    }

    /// The checks that do not depend on a namespace.
    fn check_fields(&self) -> Result<(), Status> {
        // SES 2 asks for a cryptographic erase (FNA bit 2 says we have none);
        // 3..=7 are reserved. PI 4..=7 are reserved.
        if self.ses > SES_USER_DATA || self.pi > 3 {
            return Err(Status::INVALID_FIELD);
        }
        Ok(())
    }

    /// What namespace `ns` becomes, or why it cannot be formatted so.
    fn new_info(&self, ns: &Ns) -> Result<BlockInfo, Status> {
        // Namespace is Write Protected: "the command is prohibited while the
        // namespace is write protected" (Namespace Write Protection, NVMe 2.0
        // §8.12); NSATTR bit 0 reports ours as such.
        if ns.info.read_only {
            return Err(Status::NAMESPACE_WRITE_PROTECTED);
        }
        let (formats, _) = lba_formats(&ns.info.block_size);
        let Some(&bs) = formats.get(self.lbaf) else {
            return Err(Status::INVALID_FORMAT);
        };
        // §5.23: enabling protection information without enough metadata per LBA
        // is an Invalid Format; no format has metadata.
        if self.pi != 0 {
            return Err(Status::INVALID_FORMAT);
        }
        let base = ns.dev.info();
        match ns.dev.format_support() {
            FormatSupport::Exclusive { min_block_size }
                if min_block_size > 0 && bs >= min_block_size && bs % min_block_size == 0 => {}
            // Below the backend's I/O alignment (e.g. 512 on a 4Kn device with
            // O_DIRECT), or a backend that cannot change at all.
            FormatSupport::Exclusive { .. } | FormatSupport::Unsupported => {
                return Err(Status::INVALID_FORMAT)
            }
            // Not the guest's to erase or reshape: Invalid Namespace or Format.
            FormatSupport::Shared => return Err(Status::INVALID_NAMESPACE),
        }
        let num_blocks = base.size_bytes() / u64::from(bs);
        if num_blocks == 0 {
            return Err(Status::INVALID_FORMAT);
        }
        Ok(BlockInfo {
            block_size: bs,
            num_blocks,
            ..base.clone()
        })
    }
}

/// `ns`'s facts in LBA size `block_size`, if a Format NVM could give it that size
/// (a restored controller takes the format its predecessor's host chose).
pub(crate) fn info_in_block_size(ns: &Ns, block_size: u32) -> Result<BlockInfo, Status> {
    let (formats, _) = lba_formats(&ns.info.block_size);
    let lbaf = formats
        .iter()
        .position(|f| *f == block_size)
        .ok_or(Status::INVALID_FORMAT)?;
    FormatCmd {
        lbaf,
        mset: false,
        pi: 0,
        pil: false,
        ses: 0,
    }
    .new_info(ns)
}

/// One namespace being formatted: its backend and its facts in the new format.
struct Target {
    nsid: u32,
    dev: Arc<dyn BlockDevice>,
    info: BlockInfo,
}

/// One request on the erase thread's own channel, polled until it completes.
fn run(chan: &mut dyn IoChannel, op: IoOp, offset: u64, len: u64) -> Result<(), Status> {
    let req = IoRequest::without_data(op, offset, len, false);
    let mut done = chan.submit(0, &req);
    // No time limit: a large erase request may take long; cancelling waits for it.
    engine::wait_until(Duration::MAX, Duration::from_micros(100), || {
        if done.is_none() {
            chan.flush();
            chan.poll(&mut |_, st| done = Some(st));
        }
        done.is_some()
    });
    let st = done.unwrap_or(IoStatus::IoError);
    match st {
        IoStatus::Ok => Ok(()),
        IoStatus::Unsupported => Err(Status::INTERNAL_ERROR),
        st => Err(<Nvme as frontend_core::Protocol>::from_io(
            st,
            bdev::IoOp::WriteZeroes,
        )),
    }
}

/// Zeroes the whole backend, then makes that durable.
fn erase(job: &Job, dev: &dyn BlockDevice) -> Result<(), Status> {
    let mut chan = dev.channel().map_err(|e| {
        tracing::warn!(
            "nvme: format: cannot open a channel on {}: {e}",
            dev.describe()
        );
        Status::INTERNAL_ERROR
    })?;
    let size = dev.info().size_bytes();
    let mut off = 0u64;
    while off < size {
        let len = (size - off).min(ERASE_CHUNK);
        job.step(|| run(chan.as_mut(), IoOp::WriteZeroes, off, len))?;
        off += len;
    }
    job.step(|| run(chan.as_mut(), IoOp::Flush, 0, 0))
}

fn erase_thread(me: Weak<Inner>, job: Arc<Job>, targets: Vec<Target>) {
    let status = targets
        .iter()
        .try_for_each(|t| erase(&job, t.dev.as_ref()))
        .err()
        .unwrap_or(Status::SUCCESS);
    if let Some(inner) = me.upgrade() {
        inner.finish_format(&targets, status, &job);
    }
}

impl Inner {
    /// Format NVM: checks, then starts the erase; the command completes when it ends.
    pub(super) fn format_nvm(&self, st: &mut State, sqe: &Sqe) -> Done {
        let cmd = FormatCmd::parse(sqe.cdw(10));
        let nsid = sqe.nsid();
        let nsids: Vec<u32> = if nsid == NSID_ALL {
            st.ns
                .iter()
                .enumerate()
                .filter(|(_, n)| n.is_some())
                .filter_map(|(i, _)| u32::try_from(i + 1).ok())
                .collect()
        } else if st.ns(nsid).is_some() {
            vec![nsid]
        } else {
            return err(Status::INVALID_NAMESPACE);
        };
        if let Err(s) = cmd.check_fields() {
            return err(s);
        }
        if st.format.is_some() {
            return err(Status::FORMAT_IN_PROGRESS);
        }
        // All or nothing: every target is checked before any is touched.
        let mut targets = Vec::with_capacity(nsids.len());
        for &id in &nsids {
            let Some(ns) = st.ns(id) else {
                continue;
            };
            match cmd.new_info(ns) {
                Ok(info) => targets.push(Target {
                    nsid: id,
                    dev: ns.dev.clone(),
                    info,
                }),
                Err(s) => return err(s),
            }
        }
        if targets.is_empty() {
            return ok(0);
        }
        if !self.begin_format(st, &nsids) {
            return err(Status::COMMAND_SEQUENCE_ERROR);
        }
        trace::limited!(
            self.shared.log,
            info,
            nsid = format_args!("{nsid:#x}"),
            lba_size = targets[0].info.block_size,
            ses = cmd.ses,
            "nvme: format started"
        );
        let job = Arc::new(Job::default());
        let (me, j) = (self.me.clone(), job.clone());
        let spawned = sandbox::spawn(sandbox::Role::NvmeAdmin, "nvme-format".into(), move || {
            erase_thread(me, j, targets)
        });
        if let Err(e) = spawned {
            tracing::error!("nvme: cannot start the format thread: {e}");
            self.end_formatting(st, &nsids);
            return err(Status::INTERNAL_ERROR);
        }
        st.format = Some(FormatRun {
            cid: Some(sqe.cid()),
            nsids,
            job,
        });
        None
    }

    /// Marks the namespaces formatting in every queue group, unless a group has
    /// requests in flight on one of them (then nothing changes: `false`). All
    /// groups are off their reactors together, so the answer holds for all.
    fn begin_format(&self, st: &mut State, nsids: &[u32]) -> bool {
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        let mut taken = Vec::with_capacity(ids.len());
        for cqid in ids {
            if let Some(g) = self.take_group(st, cqid) {
                taken.push(g);
            }
        }
        let busy = taken.iter().any(|g| nsids.iter().any(|&n| g.ns_busy(n)));
        if !busy {
            for &nsid in nsids {
                let Some(ns) = st.ns_mut(nsid) else {
                    continue;
                };
                ns.formatting = true;
                for g in &mut taken {
                    g.apply(NsChange::Format {
                        nsid,
                        info: ns.info.clone(),
                        formatting: true,
                    });
                }
            }
        }
        for g in taken {
            if let Err(s) = self.place_group(st, g) {
                tracing::error!(status = ?s, "nvme: queue group lost while starting a format");
            }
        }
        !busy
    }

    /// Takes the formatting mark off, keeping each namespace's facts.
    fn end_formatting(&self, st: &mut State, nsids: &[u32]) {
        for &nsid in nsids {
            let Some(ns) = st.ns_mut(nsid) else {
                continue;
            };
            ns.formatting = false;
            let info = ns.info.clone();
            self.change_groups(st, || {
                Some(NsChange::Format {
                    nsid,
                    info: info.clone(),
                    formatting: false,
                })
            });
        }
    }

    /// The erase ended: the namespaces take their new format (or keep the old one
    /// if it failed), the command completes and the host hears of the change.
    fn finish_format(&self, targets: &[Target], status: Status, job: &Arc<Job>) {
        let mut st = self.lock();
        let run = match st.format.take() {
            Some(r) if Arc::ptr_eq(&r.job, job) => r,
            other => {
                st.format = other;
                return;
            }
        };
        let mut formatted = Vec::new();
        for t in targets {
            // A namespace removed (or replaced) meanwhile is not touched.
            let same = |n: &&mut Ns| Arc::ptr_eq(&n.dev, &t.dev);
            let Some(ns) = st.ns_mut(t.nsid).filter(same) else {
                continue;
            };
            if status.is_ok() {
                ns.info = t.info.clone();
                formatted.push(t.nsid);
            }
        }
        self.end_formatting(&mut st, &run.nsids);
        for &nsid in &formatted {
            self.namespace_changed(&mut st, nsid);
        }
        trace::limited!(
            self.shared.log,
            info,
            status = format_args!("{:#x}", status.0),
            namespaces = formatted.len(),
            "nvme: format finished"
        );
        if let (Some(cid), true) = (run.cid, st.admin.is_some()) {
            st.done.push_back((cid, status));
        }
        self.admin_poll(&mut st);
    }

    /// Stops a format's erase (see `Job::cancel`); it then ends on its own.
    pub(crate) fn cancel_format(&self, st: &State) {
        if let Some(run) = &st.format {
            run.job.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdw10_fields() {
        let c = FormatCmd::parse(1 | 1 << 4 | 3 << 5 | 1 << 8 | 2 << 9 | 1 << 12);
        assert_eq!(
            c,
            FormatCmd {
                lbaf: 0x11,
                mset: true,
                pi: 3,
                pil: true,
                ses: 2,
            }
        );
        assert_eq!(FormatCmd::parse(0).lbaf, 0);
        assert_eq!(FormatCmd::parse(0xffff_ffff).lbaf, 0x3f);
        assert_eq!(FormatCmd::parse(1 << 9).check_fields(), Ok(()));
        for bad in [2 << 9, 7 << 9, 4 << 5] {
            assert_eq!(
                FormatCmd::parse(bad).check_fields(),
                Err(Status::INVALID_FIELD)
            );
        }
    }

    fn ns(dev: impl BlockDevice + 'static) -> Ns {
        Ns::new(Arc::new(dev).into())
    }

    #[test]
    fn new_facts_and_refusals() {
        let ram = ns(bdev::RamDisk::new(1 << 20, 512).unwrap());
        let to = |lbaf: u32, n: &Ns| FormatCmd::parse(lbaf).new_info(n);
        let i = to(1, &ram).unwrap();
        assert_eq!((i.block_size, i.num_blocks), (4096, 256));
        let i = to(0, &ram).unwrap();
        assert_eq!((i.block_size, i.num_blocks), (512, 2048));
        assert_eq!(to(2, &ram), Err(Status::INVALID_FORMAT));
        assert_eq!(to(1 << 12, &ram), Err(Status::INVALID_FORMAT), "LBAFU");
        assert_eq!(to(1 | 1 << 5, &ram), Err(Status::INVALID_FORMAT), "PI");
        assert!(to(1 | 1 << 4 | 1 << 8, &ram).is_ok(), "MSET, PIL ignored");
        // A size that is not a multiple of 4096: the tail is cut off.
        let odd = ns(bdev::NullDisk::new(4096 + 512, 512).unwrap());
        assert_eq!(to(1, &odd).unwrap().num_blocks, 1);
        let small = ns(bdev::NullDisk::new(1024, 512).unwrap());
        assert_eq!(to(1, &small), Err(Status::INVALID_FORMAT));
        let slice = ns(bdev::SliceDisk::new(ram.dev.clone(), 0, 4096).unwrap());
        assert_eq!(to(1, &slice), Err(Status::INVALID_NAMESPACE));
        let mut ro = ram.clone();
        ro.info.read_only = true;
        assert_eq!(to(1, &ro), Err(Status::NAMESPACE_WRITE_PROTECTED));
    }
}
