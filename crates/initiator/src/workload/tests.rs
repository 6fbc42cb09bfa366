use std::sync::Mutex;
use std::time::Duration;

use super::*;

/// A RAM disk that completes every I/O at the next poll; `corrupt_every` flips a byte
/// in every n-th read to prove verify catches it.
struct MemTarget {
    data: Mutex<Vec<u8>>,
    corrupt_every: u64,
}

struct MemJob<'a> {
    t: &'a MemTarget,
    bufs: Vec<Vec<u8>>,
    pending: Vec<IoDone>,
    reads: u64,
}

impl IoTarget for MemTarget {
    fn block_size(&self) -> u32 {
        512
    }
    fn size_bytes(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn open_job(&self, _job: u32, slots: u32, buf_len: u32) -> Result<Box<dyn JobQueue + '_>> {
        Ok(Box::new(MemJob {
            t: self,
            bufs: vec![vec![0; buf_len as usize]; slots as usize],
            pending: Vec::with_capacity(slots as usize),
            reads: 0,
        }))
    }
}

impl JobQueue for MemJob<'_> {
    fn submit(&mut self, op: Op, offset: u64, len: u32, slot: u32) -> Result<()> {
        let mut d = self.t.data.lock().unwrap();
        let r = offset as usize..offset as usize + len as usize;
        let b = &mut self.bufs[slot as usize];
        match op {
            Op::Read => {
                b.copy_from_slice(&d[r]);
                self.reads += 1;
                if self.t.corrupt_every != 0 && self.reads.is_multiple_of(self.t.corrupt_every) {
                    b[7] ^= 0xff;
                }
            }
            Op::Write => d[r].copy_from_slice(b),
        }
        self.pending.push(IoDone { slot, status: 0 });
        Ok(())
    }
    fn commit(&mut self) -> Result<()> {
        Ok(())
    }
    fn poll(&mut self, out: &mut Vec<IoDone>) -> Result<usize> {
        let n = self.pending.len();
        out.append(&mut self.pending);
        Ok(n)
    }
    fn write_buf(&mut self, slot: u32, off: usize, data: &[u8]) -> Result<()> {
        self.bufs[slot as usize][off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read_buf(&mut self, slot: u32, off: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&self.bufs[slot as usize][off..off + out.len()]);
        Ok(())
    }
}

fn cfg(rw: Rw, verify: bool) -> WorkloadConfig {
    WorkloadConfig {
        rw,
        bs: 4096,
        qd: 8,
        jobs: 3,
        time: Duration::from_millis(200),
        verify,
        ..Default::default()
    }
}

#[test]
fn randrw_verify_is_clean_on_a_good_target() {
    let t = MemTarget {
        data: Mutex::new(vec![0; 1 << 20]),
        corrupt_every: 0,
    };
    let r = run(&t, &cfg(Rw::RandRw { read_pct: 50 }, true)).unwrap();
    // Every slot of every job went round (how many more depends on the machine).
    assert!(r.ios >= 24, "{r}");
    assert_eq!(r.ios, r.reads + r.writes);
    assert_eq!((r.errors, r.verify_errors), (0, 0));
    assert_eq!(r.jobs.len(), 3);
    assert!(r.iops > 0.0 && r.lat_ns.max >= r.lat_ns.p50);
}

#[test]
fn read_only_verify_prefills_and_catches_corruption() {
    let t = MemTarget {
        data: Mutex::new(vec![0; 256 << 10]),
        corrupt_every: 0,
    };
    let r = run(&t, &cfg(Rw::RandRead, true)).unwrap();
    assert_eq!(r.unverified_reads, 0);
    assert_eq!(r.verify_errors, 0);
    assert_eq!(r.writes, 0, "prefill is not measured");

    let bad = MemTarget {
        data: Mutex::new(vec![0; 256 << 10]),
        corrupt_every: 10,
    };
    let r = run(&bad, &cfg(Rw::Read, true)).unwrap();
    assert!(r.verify_errors > 0);
}

#[test]
fn sequential_write_and_bad_config() {
    let t = MemTarget {
        data: Mutex::new(vec![0; 64 << 10]),
        corrupt_every: 0,
    };
    let mut c = cfg(Rw::Write, false);
    c.ramp = Duration::from_millis(50);
    let r = run(&t, &c).unwrap();
    assert!(r.writes > 0 && r.reads == 0);
    c.bs = 1000;
    assert!(run(&t, &c).is_err());
    assert_eq!("randrw70".parse::<Rw>(), Ok(Rw::RandRw { read_pct: 70 }));
    assert!("bogus".parse::<Rw>().is_err());
}

#[test]
fn a_think_time_longer_than_the_run_makes_an_idle_client() {
    let t = MemTarget {
        data: Mutex::new(vec![0; 64 << 10]),
        corrupt_every: 0,
    };
    let mut c = cfg(Rw::RandRead, false);
    c.ramp = Duration::from_millis(50);
    // An hour: a run that slept it out would never return in a test's time.
    c.think = Duration::from_secs(3600);
    let r = run(&t, &c).unwrap();
    // The first I/Os complete within the warm-up; then nothing until the end.
    assert_eq!(r.ios, 0, "{r}");
    assert_eq!(r.errors, 0);
}
