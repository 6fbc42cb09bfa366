//! [`RemoteDma::transfer`] over a [`Port`]: ops cut into one message's worth each,
//! sent as far as the windows allow, replies taken as they come, the window
//! refilled, until every piece is answered or the port fails.

use std::sync::atomic::Ordering;
use std::time::Instant;

use guest_mem::{RemoteDir, RemoteDma, RemoteError, RemoteOp};

use super::{lock, Port, READ_PIECE, READ_WINDOW, WINDOW};
use crate::msg::Msg;
use crate::proto::{Command, DmaWire};

/// One message's share of an op.
struct Piece {
    op: usize,
    off: usize,
    len: u32,
    iova: u64,
    id: u16,
    done: bool,
}

/// Data in flight per direction, held within its window.
#[derive(Default)]
struct InFlight {
    /// DMA_READ: the client's replies carry the data.
    reads: usize,
    /// DMA_WRITE: our requests carry it.
    writes: usize,
}

impl InFlight {
    fn of(&mut self, dir: RemoteDir) -> &mut usize {
        match dir {
            RemoteDir::FromClient => &mut self.reads,
            RemoteDir::ToClient => &mut self.writes,
        }
    }

    /// Whether `n` more bytes fit; one piece always does, or nothing would move.
    fn fits(&self, dir: RemoteDir, n: usize) -> bool {
        match dir {
            RemoteDir::FromClient => self.reads == 0 || self.reads + n <= READ_WINDOW,
            RemoteDir::ToClient => self.writes == 0 || self.writes + n <= WINDOW,
        }
    }
}

/// One `transfer` call's pieces and what of them is on its way.
struct Flight<'p> {
    port: &'p Port,
    wire: DmaWire,
    pieces: Vec<Piece>,
    /// The next piece to send.
    next: usize,
    /// Pieces sent and not answered (indices into `pieces`).
    out: Vec<usize>,
    in_flight: InFlight,
    /// The next reply is due by then (each reply restarts the port's timeout).
    deadline: Instant,
}

impl RemoteDma for Port {
    fn transfer(&self, ops: &mut [RemoteOp<'_>]) {
        let Some(first) = ops.iter().find(|o| !o.buf.is_empty()).map(|o| o.iova) else {
            return;
        };
        let wire = match self.layout(first) {
            Ok(w) => w,
            Err(e) => {
                if e == RemoteError::Timeout {
                    self.fail_timeout();
                }
                for op in ops.iter_mut() {
                    op.result = Err(e);
                }
                return;
            }
        };
        let mut flight = Flight {
            port: self,
            wire,
            pieces: split(ops, self.max_xfer),
            next: 0,
            out: Vec::new(),
            in_flight: InFlight::default(),
            deadline: Instant::now() + self.timeout,
        };
        if let Err(e) = flight.run(ops) {
            flight.fail_unanswered(ops, e);
        }
    }

    fn set_paused(&self, paused: bool) {
        let mut st = lock(&self.st);
        if paused {
            st.paused += 1;
        } else {
            st.paused = st.paused.saturating_sub(1);
        }
        drop(st);
        self.cv.notify_all();
    }
}

/// Cuts the ops into pieces of at most one message's data (DMA_READ replies
/// smaller still: see `READ_PIECE`). Every op's result starts `Ok`; an op whose
/// addresses wrap fails at once.
fn split(ops: &mut [RemoteOp<'_>], max_xfer: u32) -> Vec<Piece> {
    let mut pieces = Vec::new();
    for (i, op) in ops.iter_mut().enumerate() {
        op.result = Ok(());
        let max = match op.dir {
            RemoteDir::FromClient => (max_xfer as usize).min(READ_PIECE),
            RemoteDir::ToClient => max_xfer as usize,
        };
        let mut off = 0;
        while off < op.buf.len() {
            let n = (op.buf.len() - off).min(max);
            let Some(iova) = op.iova.checked_add(off as u64) else {
                op.result = Err(RemoteError::BadReply);
                break;
            };
            pieces.push(Piece {
                op: i,
                off,
                len: u32::try_from(n).unwrap_or(u32::MAX),
                iova,
                id: 0,
                done: false,
            });
            off += n;
        }
    }
    pieces
}

impl Flight<'_> {
    /// Sends and waits until every piece is answered. An error of the port
    /// (closed, paused, no reply in time) ends it; the pieces not answered then
    /// fail with it.
    fn run(&mut self, ops: &mut [RemoteOp<'_>]) -> Result<(), RemoteError> {
        loop {
            self.send_window(ops)?;
            if self.out.is_empty() {
                return Ok(());
            }
            let ids: Vec<u16> = self.out.iter().map(|&i| self.pieces[i].id).collect();
            match self.port.wait_any(&ids, self.deadline) {
                Ok(replies) => {
                    self.deadline = Instant::now() + self.port.timeout;
                    for (id, m) in replies {
                        self.receive(ops, id, &m);
                    }
                }
                Err(e) => {
                    self.port.abandon(&ids);
                    if e == RemoteError::Timeout {
                        self.port.fail_timeout();
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Sends the next pieces while they fit their window. A piece whose op failed
    /// already is skipped; a port closed or paused ends the transfer.
    fn send_window(&mut self, ops: &mut [RemoteOp<'_>]) -> Result<(), RemoteError> {
        while let Some(p) = self.pieces.get(self.next) {
            if !self.in_flight.fits(ops[p.op].dir, p.len as usize) {
                break;
            }
            let i = self.next;
            self.next += 1;
            let p = &mut self.pieces[i];
            if ops[p.op].result.is_err() {
                p.done = true;
                continue;
            }
            match self.port.send_piece(self.wire, &ops[p.op], p) {
                Ok(id) => {
                    p.id = id;
                    *self.in_flight.of(ops[p.op].dir) += p.len as usize;
                    self.out.push(i);
                }
                Err(e) => {
                    p.done = true;
                    ops[p.op].result = Err(e);
                    if matches!(e, RemoteError::Closed | RemoteError::Paused) {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Takes the reply to the piece sent as `id` (one we gave up on is ignored):
    /// checks it and, for a read, copies its data in; a bad reply fails its op.
    fn receive(&mut self, ops: &mut [RemoteOp<'_>], id: u16, m: &Msg) {
        let Some(at) = self.out.iter().position(|&i| self.pieces[i].id == id) else {
            return;
        };
        let p = &mut self.pieces[self.out.swap_remove(at)];
        p.done = true;
        *self.in_flight.of(ops[p.op].dir) -= p.len as usize;
        let stats = &self.port.stats;
        match self.port.apply(self.wire, &ops[p.op], p, m) {
            Ok(()) => {
                let ctr = match ops[p.op].dir {
                    RemoteDir::FromClient => &stats.bytes_read,
                    RemoteDir::ToClient => &stats.bytes_written,
                };
                ctr.fetch_add(u64::from(p.len), Ordering::Relaxed);
            }
            Err(e) => {
                stats.bad_replies.fetch_add(1, Ordering::Relaxed);
                trace::limited!(
                    self.port.log,
                    warn,
                    "vfio-user: DMA request for {:#x}+{:#x} failed: {e}",
                    p.iova,
                    p.len
                );
                if ops[p.op].result.is_ok() {
                    ops[p.op].result = Err(e);
                }
            }
        }
    }

    /// After a failure of the port: every op with a piece not answered gets it
    /// (unless it failed already).
    fn fail_unanswered(&self, ops: &mut [RemoteOp<'_>], e: RemoteError) {
        for p in self.pieces.iter().filter(|p| !p.done) {
            if ops[p.op].result.is_ok() {
                ops[p.op].result = Err(e);
            }
        }
    }
}

impl Port {
    fn fail_timeout(&self) {
        self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
        trace::limited!(
            self.log,
            warn,
            "vfio-user: the client did not answer a DMA request within {:?}; \
             the transfer fails",
            self.timeout
        );
    }

    /// Checks one reply against its piece and, for a read, copies its data in.
    fn apply(
        &self,
        wire: DmaWire,
        op: &RemoteOp<'_>,
        p: &Piece,
        m: &Msg,
    ) -> Result<(), RemoteError> {
        let cmd = match op.dir {
            RemoteDir::FromClient => Command::DmaRead,
            RemoteDir::ToClient => Command::DmaWrite,
        };
        if m.hdr.cmd != cmd as u16 || !m.fds.is_empty() {
            return Err(RemoteError::BadReply);
        }
        if m.hdr.is_error() {
            return Err(RemoteError::Refused(
                i32::try_from(m.hdr.error).unwrap_or(libc::EIO),
            ));
        }
        match op.dir {
            RemoteDir::FromClient => {
                let data = wire
                    .read_reply_data(&m.payload, p.iova, p.len)
                    .ok_or(RemoteError::BadReply)?;
                op.buf
                    .write_from(p.off, data)
                    .map_err(|_| RemoteError::BadReply)
            }
            RemoteDir::ToClient => wire
                .write_reply_ok(&m.payload, p.iova, p.len)
                .then_some(())
                .ok_or(RemoteError::BadReply),
        }
    }

    fn send_piece(&self, wire: DmaWire, op: &RemoteOp<'_>, p: &Piece) -> Result<u16, RemoteError> {
        match op.dir {
            RemoteDir::FromClient => {
                let req = wire.read_request(p.iova, p.len);
                let id = self.send_request(Command::DmaRead, &[&req])?;
                self.stats.reads.fetch_add(1, Ordering::Relaxed);
                Ok(id)
            }
            RemoteDir::ToClient => {
                let (head, tail) = wire.write_request_head(p.iova, p.len);
                let mut data = vec![0u8; p.len as usize + tail];
                op.buf
                    .read_into(p.off, &mut data[..p.len as usize])
                    .map_err(|_| RemoteError::BadReply)?;
                let id = self.send_request(Command::DmaWrite, &[&head, &data])?;
                self.stats.writes.fetch_add(1, Ordering::Relaxed);
                Ok(id)
            }
        }
    }
}
