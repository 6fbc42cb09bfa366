//! Entry points for the coverage-guided fuzzer (`fuzz/`, cargo feature `fuzzing`).

use std::sync::Arc;

use guest_mem::{Access, MappedRegion, MemoryMap};

use crate::iov::Iov;

/// Guest memory of the data-pointer target: a 64 KiB region at 0x10000 and a
/// 16 KiB one at 0x40000, filled from the input.
const REGIONS: [(u64, u64); 2] = [(0x10000, 0x10000), (0x40000, 0x4000)];

fn le<const N: usize>(d: &[u8], at: usize) -> [u8; N] {
    let mut b = [0u8; N];
    for (i, x) in b.iter_mut().enumerate() {
        *x = d.get(at + i).copied().unwrap_or(0);
    }
    b
}

/// A command's data pointer (PRP1/PRP2 with PRP lists, or SGL1 with segments)
/// walked against guest memory whose bytes (the lists and descriptors) come from
/// the input. Layout: `[psdt][write][len u32][prp1 u64][prp2 u64][sgl1 16]`, then
/// the memory image.
pub fn data_pointer(data: &[u8]) {
    let Ok(map) = memory(data.get(38..).unwrap_or_default()) else {
        return;
    };
    let psdt = data.first().copied().unwrap_or(0) % 3;
    let access = if data.get(1).copied().unwrap_or(0) & 1 == 0 {
        Access::Read
    } else {
        Access::Write
    };
    // Up to 2 MiB + a page: beyond MDTS the caller refuses before walking.
    let len = u64::from(u32::from_le_bytes(le(data, 2)) % ((2 << 20) + 4096));
    let prp1 = u64::from_le_bytes(le(data, 6));
    let prp2 = u64::from_le_bytes(le(data, 14));
    let sgl1: [u8; 16] = le(data, 22);
    let mut iov = Iov::new();
    iov.next_command();
    let r = match psdt {
        0 => crate::prp::walk(&map, prp1, prp2, len, access, &mut iov),
        _ => crate::sgl::walk(&map, sgl1, len, access, &mut iov),
    };
    if r.is_ok() && iov.has_room() {
        let got: u64 = iov
            .segments(iov.range())
            .iter()
            .map(|s| s.len() as u64)
            .sum();
        assert_eq!(got, len, "a successful walk covers exactly the transfer");
    }
}

fn memory(image: &[u8]) -> std::io::Result<MemoryMap> {
    let mut map = MemoryMap::new();
    let mut at = 0usize;
    for (iova, len) in REGIONS {
        let r = MappedRegion::anonymous(iova, len)?;
        let take = image.len().saturating_sub(at).min(len as usize);
        if let Some(s) = r.slice(0, take) {
            let _ = s.write_from(0, &image[at..at + take]);
        }
        at += take;
        map = map
            .with_region(Arc::new(r))
            .map_err(std::io::Error::other)?;
    }
    Ok(map)
}

/// Guest memory of the admin target, mapped in the controller's DMA space too so
/// that queues it creates point into it.
const ADMIN_MEM: (u64, u64) = (0x10000, 0x20000);
/// Commands per input at most.
const ADMIN_BATCH: usize = 8;

struct AdminRig {
    ctrl: crate::Controller,
    region: Arc<MappedRegion>,
    map: Arc<MemoryMap>,
}

struct NoIrqs;

impl crate::InterruptSink for NoIrqs {
    fn signal(&self, _vector: u16) {}
}

fn admin_rig() -> std::io::Result<AdminRig> {
    let engine = engine::Engine::start(&[None]).map_err(std::io::Error::other)?;
    let placer = engine::Placer::new(engine::Placement::RoundRobin, 0, 1);
    let mem = guest_mem::DmaSpace::try_new()?;
    let region = Arc::new(MappedRegion::anonymous(ADMIN_MEM.0, ADMIN_MEM.1)?);
    mem.update(|m| m.with_region(region.clone()))
        .map_err(std::io::Error::other)?;
    let (_, map) = mem.snapshot();
    let disk: Arc<dyn bdev::BlockDevice> = Arc::new(bdev::RamDisk::new(1 << 20, 512)?);
    let ctrl = crate::Controller::new(
        crate::ControllerConfig::default(),
        vec![Some(disk), None],
        engine,
        placer,
        mem,
        Arc::new(NoIrqs),
    )
    .map_err(std::io::Error::other)?;
    Ok(AdminRig { ctrl, region, map })
}

/// Admin commands run one after another on an enabled controller with one RAM
/// namespace and an inactive NSID 2, against guest memory (PRP lists, data
/// buffers, queue memory at 0x10000..0x30000) from the input. Layout: `[count]`,
/// then `count % 8 + 1` SQEs of 64 bytes, then the memory image. Each input starts
/// from a controller that was just disabled (no queues, default features).
pub fn admin_commands(data: &[u8]) {
    static RIG: std::sync::OnceLock<Option<AdminRig>> = std::sync::OnceLock::new();
    let Some(rig) = RIG.get_or_init(|| admin_rig().ok()) else {
        return;
    };
    let n = usize::from(data.first().copied().unwrap_or(0)) % ADMIN_BATCH + 1;
    let sqes = data.get(1..).unwrap_or_default();
    let image = data.get(1 + n * 64..).unwrap_or_default();
    if let Some(all) = rig.region.slice(0, ADMIN_MEM.1 as usize) {
        all.fill(0);
        let take = image.len().min(ADMIN_MEM.1 as usize);
        let _ = all.write_from(0, &image[..take]);
    }
    let inner = &rig.ctrl.inner;
    let mut st = inner.lock();
    inner.disable(&mut st);
    // Enabled with 64-byte SQEs and 16-byte CQEs, as every driver sets CC.
    st.regs.cc = 1 | (6 << 16) | (4 << 20);
    for i in 0..n {
        let mut sqe = crate::queue::Sqe::default();
        for (k, dw) in sqe.dw.iter_mut().enumerate() {
            *dw = u32::from_le_bytes(le(sqes, i * 64 + k * 4));
        }
        let _ = inner.exec_admin_pcie(&mut st, &rig.map, &sqe);
    }
}
