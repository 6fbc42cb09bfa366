//! Admin command set, executed on the controller's control thread.

mod data;
pub(crate) mod features;
pub(crate) mod format;
pub(crate) mod format_job;
mod pass;
mod queues;

use std::sync::atomic::Ordering;

use guest_mem::{Access, MemoryMap};

use crate::ctrl::{Inner, State};
use crate::identify;
use crate::io::{write_event_idx, write_shadow_db, Shadow};
use crate::iov::PAGE;
use crate::log::smart_page;
use crate::queue::Sqe;
use crate::status::Status;
use data::{HostData, PrpData};
use features::{FID_HOST_BEHAVIOR, FID_KEEP_ALIVE, FID_QUEUES, HOST_BEHAVIOR_LEN};

const DELETE_SQ: u8 = 0x00;
const CREATE_SQ: u8 = 0x01;
const GET_LOG_PAGE: u8 = 0x02;
const DELETE_CQ: u8 = 0x04;
const CREATE_CQ: u8 = 0x05;
const IDENTIFY: u8 = 0x06;
const ABORT: u8 = 0x08;
const SET_FEATURES: u8 = 0x09;
const GET_FEATURES: u8 = 0x0a;
const ASYNC_EVENT: u8 = 0x0c;
const KEEP_ALIVE: u8 = 0x18;
const DOORBELL_BUFFER_CONFIG: u8 = 0x7c;

/// Command Set Identifier of the NVM command set.
const CSI_NVM: u32 = 0;

const LOG_ERROR: u8 = 0x01;
const LOG_SMART: u8 = 0x02;
const LOG_FIRMWARE: u8 = 0x03;
const LOG_CHANGED_NS: u8 = 0x04;

type Done = Option<(u32, Status)>;

fn ok(dw0: u32) -> Done {
    Some((dw0, Status::SUCCESS))
}
fn err(s: Status) -> Done {
    Some((0, s))
}
fn done(r: Result<(), Status>) -> Done {
    err(r.err().unwrap_or(Status::SUCCESS))
}

impl Inner {
    /// Executes one admin command from the PCIe admin queue: the queue commands of
    /// the memory-based transport here, the rest through [`Inner::exec_admin`] with
    /// the command's PRPs as its data buffer. `None` means it stays outstanding
    /// (AER).
    pub(crate) fn exec_admin_pcie(&self, st: &mut State, map: &MemoryMap, sqe: &Sqe) -> Done {
        if sqe.fuse() != 0 {
            return err(Status::INVALID_FIELD);
        }
        match sqe.opcode() {
            DELETE_SQ => self.delete_sq(st, sqe),
            CREATE_SQ => self.create_sq(st, map, sqe),
            DELETE_CQ => self.delete_cq(st, sqe),
            CREATE_CQ => self.create_cq(st, map, sqe),
            DOORBELL_BUFFER_CONFIG => self.doorbell_buffer_config(st, map, sqe),
            _ => self.exec_admin(st, sqe, &mut PrpData::new(map, sqe)),
        }
    }

    /// Executes one admin command that does not depend on the transport; its data
    /// moves through `data`. `None` means it stays outstanding (AER).
    pub(crate) fn exec_admin(&self, st: &mut State, sqe: &Sqe, data: &mut dyn HostData) -> Done {
        if sqe.fuse() != 0 {
            return err(Status::INVALID_FIELD);
        }
        match sqe.opcode() {
            IDENTIFY => self.identify(st, sqe, data),
            GET_LOG_PAGE => self.get_log_page(st, sqe, data),
            SET_FEATURES => self.set_features(st, sqe, data),
            GET_FEATURES => self.get_features(st, sqe, data),
            ASYNC_EVENT => {
                if st.aer.len() > usize::from(identify::AERL) {
                    return err(Status::AER_LIMIT_EXCEEDED);
                }
                st.aer.push(sqe.cid());
                None
            }
            // Commands complete almost at once; "not aborted" (dw0 bit 0) is legal.
            ABORT => ok(1),
            KEEP_ALIVE => {
                st.restart_keep_alive();
                ok(0)
            }
            format::FORMAT_NVM => self.format_nvm(st, sqe),
            _ => err(Status::INVALID_OPCODE),
        }
    }

    fn set_features(&self, st: &mut State, sqe: &Sqe, data: &mut dyn HostData) -> Done {
        let fid = sqe.cdw(10) as u8;
        let save = sqe.cdw(10) & (1 << 31) != 0;
        let res = match fid {
            // NVMe 1.4 §5.21.1.7: only before any I/O queue exists.
            FID_QUEUES if !st.groups.is_empty() || !st.sq_owner.is_empty() => {
                Err(Status::COMMAND_SEQUENCE_ERROR)
            }
            FID_HOST_BEHAVIOR => {
                let mut buf = [0u8; HOST_BEHAVIOR_LEN];
                data.read_host(&mut buf)
                    .and_then(|()| st.features.set_host_behavior(save, &buf))
            }
            _ => st.features.set(fid, save, sqe.cdw(11)),
        };
        match res {
            Ok(dw0) => {
                self.shared.wce.store(st.features.wce, Ordering::Relaxed);
                self.shared
                    .publish_interrupt_features(st.features.coalescing, &st.features.no_coalesce);
                if fid == FID_KEEP_ALIVE {
                    st.restart_keep_alive();
                }
                ok(dw0)
            }
            Err(s) => err(s),
        }
    }

    fn get_features(&self, st: &State, sqe: &Sqe, data: &mut dyn HostData) -> Done {
        let fid = sqe.cdw(10) as u8;
        let sel = (sqe.cdw(10) >> 8) & 7;
        match st.features.get(fid, sel, sqe.cdw(11)) {
            Ok(v) if fid == FID_HOST_BEHAVIOR && sel != 3 => {
                match data.write_host(&st.features.host_behavior()) {
                    Ok(()) => ok(v),
                    Err(s) => err(s),
                }
            }
            Ok(v) => ok(v),
            Err(s) => err(s),
        }
    }

    fn identify(&self, st: &State, sqe: &Sqe, out: &mut dyn HostData) -> Done {
        let cns = sqe.cdw(10) as u8;
        let nsid = sqe.nsid();
        let in_range = nsid != 0 && nsid <= self.cfg.max_namespaces;
        let data = match cns {
            0x00 => match st.ns(nsid) {
                Some(ns) => identify::namespace(&self.cfg, nsid, ns),
                // A valid but inactive NSID (e.g. just removed) reads as zeroes.
                None if in_range => vec![0u8; 4096],
                None => return err(Status::INVALID_NAMESPACE),
            },
            0x01 => identify::controller(&self.cfg, self.mdts(), &st.ns),
            0x02 => {
                if nsid >= 0xffff_fffe {
                    return err(Status::INVALID_NAMESPACE);
                }
                identify::ns_list(nsid, &st.ns)
            }
            0x03 => {
                if st.ns(nsid).is_none() {
                    return err(Status::INVALID_NAMESPACE);
                }
                identify::ns_descriptors(&self.cfg, nsid)
            }
            // I/O Command Set specific structures (NVMe 2.0; Linux asks for 06h
            // whatever the version): for the NVM command set (CSI 0) they hold only
            // limits and extended formats udrive does not have, so all zero.
            // docs/decisions/0011-nvme-conformance.md
            0x05 | 0x06 if sqe.cdw(11) >> 24 != CSI_NVM => return err(Status::INVALID_FIELD),
            0x05 if in_range => vec![0u8; 4096],
            0x05 => return err(Status::INVALID_NAMESPACE),
            0x06 => vec![0u8; 4096],
            _ => return err(Status::INVALID_FIELD),
        };
        done(out.write_host(&data))
    }

    pub(crate) fn mdts(&self) -> u8 {
        crate::iov::effective_mdts(self.cfg.mdts)
    }

    fn get_log_page(&self, st: &mut State, sqe: &Sqe, data: &mut dyn HostData) -> Done {
        let lid = sqe.cdw(10) as u8;
        let numd = (sqe.cdw(10) >> 16) | ((sqe.cdw(11) & 0xffff) << 16);
        let len = (u64::from(numd) + 1) * 4;
        let offset = u64::from(sqe.cdw(12)) | (u64::from(sqe.cdw(13)) << 32);
        if offset % 4 != 0 {
            return err(Status::INVALID_FIELD);
        }
        // The host buffer may not exceed what a command may transfer.
        if len > (PAGE << self.mdts()) {
            return err(Status::INVALID_FIELD);
        }
        let page = match lid {
            LOG_ERROR => {
                let log = self.shared.errors.lock().unwrap_or_else(|e| e.into_inner());
                let mut b = Vec::with_capacity(64 * log.ring.len());
                for e in log.ring.iter().rev() {
                    b.extend_from_slice(&e.to_bytes());
                }
                b
            }
            LOG_SMART => {
                let t = self.totals(st);
                let errors = self
                    .shared
                    .errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .count;
                smart_page(&t, errors, st.features.temperature())
            }
            LOG_FIRMWARE => {
                let mut b = vec![0u8; 512];
                b[0] = 1; // active slot 1
                let mut fr = self.cfg.firmware.as_bytes().to_vec();
                fr.resize(8, b' ');
                b[8..16].copy_from_slice(&fr[..8]);
                b
            }
            LOG_CHANGED_NS => self.changed_ns_log(st, sqe.cdw(10) & (1 << 15) != 0),
            _ => return err(Status::INVALID_LOG_PAGE),
        };
        let mut out = vec![0u8; len as usize];
        if let Some(src) = usize::try_from(offset).ok().and_then(|o| page.get(o..)) {
            let n = src.len().min(out.len());
            out[..n].copy_from_slice(&src[..n]);
        } else {
            return err(Status::INVALID_FIELD);
        }
        done(data.write_host(&out))
    }

    pub(crate) fn totals(&self, st: &State) -> crate::log::Totals {
        let mut t = st.retired;
        for g in st.groups.values() {
            t.add(&g.counters);
        }
        t
    }

    fn doorbell_buffer_config(&self, st: &mut State, map: &MemoryMap, sqe: &Sqe) -> Done {
        let (db, ei) = (sqe.prp1(), sqe.prp2());
        // Not in unshared client memory: we would fetch the shadow doorbells on
        // every poll, costlier than the doorbell writes they save (the host then
        // keeps ringing doorbells, docs/decisions/0020-dma-messages.md).
        let usable = |a: u64| {
            a != 0
                && a.is_multiple_of(PAGE)
                && map.translate(a, PAGE as usize, Access::Write).is_ok()
                && !map.is_remote(a)
        };
        if sqe.psdt() != 0 || !usable(db) || !usable(ei) {
            return err(Status::INVALID_FIELD);
        }
        let shadow = Shadow { db, ei };
        st.shadow = Some(shadow);
        st.doorbell_buffer_configs += 1;
        trace::limited!(
            self.shared.log,
            info,
            shadow = format_args!("{db:#x}"),
            event_idx = format_args!("{ei:#x}"),
            "doorbell buffer configured"
        );
        // Existing queues switch over: seed the shadow with the values we already
        // hold so the switch does not look like a doorbell jump.
        let ids: Vec<u16> = st.groups.keys().copied().collect();
        for cqid in ids {
            let Some(mut g) = self.take_group(st, cqid) else {
                continue;
            };
            g.set_shadow(shadow);
            write_shadow_db(map, shadow, g.out.cq.qid, true, g.out.cq.head);
            write_event_idx(map, shadow, g.out.cq.qid, true, g.out.cq.head);
            for sq in &g.sqs {
                write_shadow_db(map, shadow, sq.ring.qid, false, sq.ring.head);
                write_event_idx(map, shadow, sq.ring.qid, false, sq.ring.head);
            }
            if let Err(s) = self.place_group(st, g) {
                return err(s);
            }
        }
        ok(0)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A transport that carries data in the command capsule (as NVMe-oF does), not
    /// through PRPs in guest memory.
    struct Capsule(Vec<u8>);

    impl HostData for Capsule {
        fn write_host(&mut self, data: &[u8]) -> Result<(), Status> {
            self.0 = data.to_vec();
            Ok(())
        }

        fn read_host(&mut self, buf: &mut [u8]) -> Result<(), Status> {
            let src = self.0.get(..buf.len()).ok_or(Status::DATA_TRANSFER_ERROR)?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    struct NoIrqs;

    impl crate::InterruptSink for NoIrqs {
        fn signal(&self, _vector: u16) {}
    }

    fn controller() -> crate::Controller {
        let engine = engine::Engine::start(&[None]).unwrap();
        let placer = engine::Placer::new(engine::Placement::RoundRobin, 0, 1);
        let disk: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(1 << 20, 512).unwrap());
        crate::Controller::new(
            crate::ControllerConfig::default(),
            vec![Some(disk)],
            engine,
            placer,
            guest_mem::DmaSpace::try_new().unwrap(),
            Arc::new(NoIrqs),
        )
        .unwrap()
    }

    fn sqe(opcode: u8, nsid: u32, cdw10: u32) -> Sqe {
        let mut s = Sqe::default();
        s.dw[0] = u32::from(opcode);
        s.dw[1] = nsid;
        s.dw[10] = cdw10;
        s
    }

    #[test]
    fn admin_commands_move_their_data_through_the_transport() {
        let ctrl = controller();
        let inner = &ctrl.inner;
        let mut st = inner.lock();
        let mut data = Capsule(Vec::new());

        let done = inner.exec_admin(&mut st, &sqe(IDENTIFY, 0, 1), &mut data);
        assert_eq!(done, ok(0));
        assert_eq!(data.0.len(), 4096);
        assert_eq!(&data.0[24..35], b"udrive NVMe");

        let done = inner.exec_admin(&mut st, &sqe(IDENTIFY, 1, 0), &mut data);
        assert_eq!(done, ok(0));
        let nsze = u64::from_le_bytes(data.0[..8].try_into().unwrap());
        assert_eq!(nsze, (1 << 20) / 512);

        // Host Behavior Support in from the capsule, and back out.
        let mut hbs = vec![0u8; HOST_BEHAVIOR_LEN];
        hbs[0] = 1;
        let mut data = Capsule(hbs);
        let set = sqe(SET_FEATURES, 0, u32::from(FID_HOST_BEHAVIOR));
        assert_eq!(inner.exec_admin(&mut st, &set, &mut data), ok(0));
        let mut data = Capsule(Vec::new());
        let get = sqe(GET_FEATURES, 0, u32::from(FID_HOST_BEHAVIOR));
        assert_eq!(inner.exec_admin(&mut st, &get, &mut data), ok(0));
        assert_eq!(data.0.first(), Some(&1));

        // A buffer the transport cannot fill fails with its status.
        let mut short = Capsule(vec![0; 4]);
        let done = inner.exec_admin(&mut st, &set, &mut short);
        assert_eq!(done, err(Status::DATA_TRANSFER_ERROR));

        // Queue creation belongs to the memory-based (PCIe) transport.
        let done = inner.exec_admin(&mut st, &sqe(CREATE_CQ, 0, 1), &mut data);
        assert_eq!(done, err(Status::INVALID_OPCODE));
    }
}
