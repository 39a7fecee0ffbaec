//! The peer's TCP server: one thread per connection, a bounded number of
//! connections (overall and per client address), request/reply exchanges
//! of the peer protocol, each under a deadline.
//!
//! - A connection waits for its next request at most `idle_timeout`; when
//!   the peer (or the client's address) is at its limit, the connection
//!   idle the longest is closed to admit a new one, and when none is idle
//!   the new one is refused [`RefusalCode::Busy`] at once.
//! - A request, from its first byte, must arrive whole within `io_timeout`.
//! - A reply of `n` data bytes must be taken within
//!   `2 * io_timeout + n / min_rate`, and every read or write waits at most
//!   `io_timeout`: the engine's own rule ([`crate::tcp::TcpOptions`]).
//!
//! A connection past a deadline is closed, so an idle, trickling or
//! non-reading client holds a slot for a bounded time only, and the accept
//! loop never waits on a client.
//!
//! Data frames go out straight from the staging: a frame larger than the
//! write buffer leaves with its header in one vectored write, smaller ones
//! gather in the buffer.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::peer::store::{PeerStore, RegionPin};
use crate::protocol::{MAX_READ_RANGES, PeerRefusal, ReadRange, RefusalCode, Request, Response, data_frame_lens};
use crate::tcp::DEFAULT_MIN_RATE;
use crate::wire::{FrameKind, HEADER_BYTES, WireError, recv_json, send_json, write_frame, write_frame_vectored};

/// A deliberate fault, for tests of the engine's error paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerFault {
    /// After sending this many data bytes on a connection, print
    /// `lora-peer: stalled` on stdout and send nothing more (the test then
    /// kills the process, or lets the engine time out).
    StallAfterBytes(u64),
}

/// Server limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerOptions {
    /// Connections served at once. Past it a new connection closes the
    /// connection idle the longest, or is refused with
    /// [`RefusalCode::Busy`] when every connection is mid-request.
    pub max_connections: usize,
    /// Connections served at once from one client address; the same rule.
    pub max_per_client: usize,
    /// A connection waiting longer for its next request is closed.
    pub idle_timeout: Duration,
    /// Limit on any single read or write, and on receiving a whole request.
    /// A connection that pinned a staging for its landing and then sends
    /// nothing for this long drops the pin (it is not landing any more).
    pub io_timeout: Duration,
    /// The slowest a client may take a reply, bytes per second: a reply of
    /// `n` bytes has `2 * io_timeout + n / min_rate`.
    pub min_rate: u64,
    /// Test only: a deliberate fault.
    pub fault: Option<PeerFault>,
}

impl Default for PeerOptions {
    fn default() -> PeerOptions {
        PeerOptions {
            max_connections: 32,
            max_per_client: 16,
            idle_timeout: Duration::from_secs(300),
            io_timeout: Duration::from_secs(30),
            min_rate: DEFAULT_MIN_RATE,
            fault: None,
        }
    }
}

/// An open connection, as the limits see it.
struct Open {
    client: IpAddr,
    /// Since when it waits for a request; `None` while it serves one.
    idle_since: Option<Instant>,
    /// A handle to close it by.
    stream: TcpStream,
}

/// The open connections.
#[derive(Default)]
struct Registry {
    next_id: u64,
    open: HashMap<u64, Open>,
}

impl Registry {
    /// Admit a connection from `client`: past a limit, close the
    /// connection idle the longest in its scope (this client's, then all),
    /// or say why it is refused.
    fn admit(&mut self, stream: &TcpStream, client: IpAddr, options: &PeerOptions) -> Result<u64, String> {
        if !self.make_room(options.max_per_client, |o| o.client == client) {
            return Err(format!(
                "{client} is at its limit of {} connections, all mid-request",
                options.max_per_client
            ));
        }
        if !self.make_room(options.max_connections, |_| true) {
            return Err(format!(
                "the peer is at its limit of {} connections, all mid-request",
                options.max_connections
            ));
        }
        let stream = stream.try_clone().map_err(|e| e.to_string())?;
        let id = self.next_id;
        self.next_id += 1;
        self.open.insert(
            id,
            Open {
                client,
                idle_since: Some(Instant::now()),
                stream,
            },
        );
        Ok(id)
    }

    /// Room for one more connection in the scope: under `limit`, or after
    /// closing its longest-idle connection.
    fn make_room(&mut self, limit: usize, in_scope: impl Fn(&Open) -> bool) -> bool {
        if self.open.values().filter(|o| in_scope(o)).count() < limit.max(1) {
            return true;
        }
        let victim = self
            .open
            .iter()
            .filter(|(_, o)| in_scope(o))
            .filter_map(|(&id, o)| Some((o.idle_since?, id)))
            .min();
        let Some((_, id)) = victim else { return false };
        if let Some(o) = self.open.remove(&id) {
            // Its thread sees the end of the stream and exits.
            let _ = o.stream.shutdown(Shutdown::Both);
        }
        true
    }

    /// Mark a connection idle or serving; `false` when it was closed for
    /// room meanwhile.
    fn set_idle(&mut self, id: u64, idle: bool) -> bool {
        match self.open.get_mut(&id) {
            Some(o) => {
                o.idle_since = idle.then(Instant::now);
                true
            }
            None => false,
        }
    }
}

fn lock(registry: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    // Every registry update is one map operation: nothing half-written.
    registry.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A weight peer: a [`PeerStore`] behind a listening socket.
pub struct Peer {
    store: Arc<PeerStore>,
    listener: TcpListener,
    options: PeerOptions,
    registry: Arc<Mutex<Registry>>,
    stop: Arc<AtomicBool>,
}

/// Takes a connection off the registry when its thread ends, however it
/// ends.
struct ConnectionSlot {
    registry: Arc<Mutex<Registry>>,
    id: u64,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        lock(&self.registry).open.remove(&self.id);
    }
}

impl Peer {
    /// Listen on `addr`. Pass a loopback address unless the peer must be
    /// reachable from other hosts.
    pub fn bind(store: PeerStore, addr: impl ToSocketAddrs, options: PeerOptions) -> io::Result<Peer> {
        Ok(Peer {
            store: Arc::new(store),
            listener: TcpListener::bind(addr)?,
            options,
            registry: Arc::default(),
            stop: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The bound address (with the port the OS picked for port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The store served.
    pub fn store(&self) -> &PeerStore {
        &self.store
    }

    /// Accept connections until [`PeerHandle::shutdown`] (or forever).
    pub fn serve(self) -> io::Result<()> {
        for stream in self.listener.incoming() {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            // A failed accept (the client reset first, fd pressure) costs
            // that connection only.
            let Ok(stream) = stream else { continue };
            let Ok(client) = stream.peer_addr().map(|a| a.ip()) else {
                continue;
            };
            let admitted = lock(&self.registry).admit(&stream, client, &self.options);
            let id = match admitted {
                Ok(id) => id,
                Err(why) => {
                    refuse_busy(stream, why);
                    continue;
                }
            };
            let slot = ConnectionSlot {
                registry: Arc::clone(&self.registry),
                id,
            };
            let store = Arc::clone(&self.store);
            let options = self.options.clone();
            // A failed spawn drops the closure, and with it the slot.
            let _ = std::thread::Builder::new()
                .name("lora-peer-conn".into())
                .spawn(move || {
                    // A connection's failure is the engine's to report.
                    let _ = Connection::new(&store, stream, &options, &slot).and_then(|mut c| c.run());
                });
        }
        Ok(())
    }

    /// Serve on a background thread.
    pub fn spawn(self) -> io::Result<PeerHandle> {
        let addr = self.local_addr()?;
        let stop = Arc::clone(&self.stop);
        let thread = std::thread::Builder::new()
            .name("lora-peer".into())
            .spawn(move || self.serve())?;
        Ok(PeerHandle {
            addr,
            stop,
            thread: Some(thread),
        })
    }
}

/// Refuse a connection: a small frame into a fresh socket's empty send
/// buffer, which does not block the accept loop.
fn refuse_busy(stream: TcpStream, why: String) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
    let mut w = BufWriter::new(stream);
    let busy = Response::Refused(PeerRefusal::new(RefusalCode::Busy, why));
    let _ = send_json(&mut w, FrameKind::Response, &busy).map(|_| w.flush());
}

/// A peer serving on a background thread; stops it when dropped.
pub struct PeerHandle {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<io::Result<()>>>,
}

impl PeerHandle {
    /// Where the peer listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting and wait for the accept loop to end (open connections
    /// end when their engine disconnects or a deadline passes).
    pub fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for PeerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One socket end under a deadline: every read or write waits at most the
/// time left, and at most `step`.
struct Paced {
    stream: TcpStream,
    deadline: Instant,
    step: Duration,
    /// The socket's read and write timeouts as this end last set them: a
    /// call whose wait is unchanged (the usual case: `step`, while more
    /// than `step` is left) makes no `setsockopt` call. Each end sets only
    /// its own direction's timeout.
    timeouts: (Option<Duration>, Option<Duration>),
}

impl Paced {
    fn new(stream: TcpStream) -> Paced {
        Paced {
            stream,
            deadline: Instant::now(),
            step: Duration::from_secs(1),
            timeouts: (None, None),
        }
    }

    /// Give the next exchange `total`, each read or write at most `step`.
    fn pace(&mut self, total: Duration, step: Duration) {
        // Far enough to mean "no deadline", near enough not to overflow.
        const FAR: Duration = Duration::from_secs(365 * 24 * 3600);
        self.deadline = Instant::now() + total.min(FAR);
        self.step = step.max(Duration::from_millis(1));
    }

    fn wait(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the deadline passed"));
        }
        Ok(left.min(self.step))
    }
}

impl Read for Paced {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let wait = Some(self.wait()?);
        if self.timeouts.0 != wait {
            self.stream.set_read_timeout(wait)?;
            self.timeouts.0 = wait;
        }
        self.stream.read(buf)
    }
}

impl Paced {
    fn before_write(&mut self) -> io::Result<()> {
        let wait = Some(self.wait()?);
        if self.timeouts.1 != wait {
            self.stream.set_write_timeout(wait)?;
            self.timeouts.1 = wait;
        }
        Ok(())
    }
}

impl Write for Paced {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.before_write()?;
        self.stream.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.before_write()?;
        self.stream.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

/// The time a reply of `bytes` data bytes is given.
fn reply_time(options: &PeerOptions, bytes: u64) -> Duration {
    let for_bytes = Duration::try_from_secs_f64(bytes as f64 / options.min_rate.max(1) as f64).unwrap_or(Duration::MAX);
    options.io_timeout.saturating_mul(2).saturating_add(for_bytes)
}

/// The landing a connection serves: the staging its last manifest pinned,
/// and how many of its bytes the connection has sent.
struct Landing<'a> {
    pin: RegionPin<'a>,
    sent: u64,
}

/// One engine connection.
struct Connection<'a> {
    store: &'a PeerStore,
    slot: &'a ConnectionSlot,
    options: &'a PeerOptions,
    reader: BufReader<Paced>,
    writer: BufWriter<Paced>,
    sent: u64,
    landing: Option<Landing<'a>>,
    #[cfg(feature = "ibverbs")]
    queue_pair: Option<crate::verbs::PeerQueuePair>,
}

fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

impl<'a> Connection<'a> {
    fn new(
        store: &'a PeerStore,
        stream: TcpStream,
        options: &'a PeerOptions,
        slot: &'a ConnectionSlot,
    ) -> io::Result<Connection<'a>> {
        stream.set_nodelay(true)?;
        Ok(Connection {
            store,
            slot,
            options,
            reader: BufReader::new(Paced::new(stream.try_clone()?)),
            writer: BufWriter::with_capacity(1 << 16, Paced::new(stream)),
            sent: 0,
            landing: None,
            #[cfg(feature = "ibverbs")]
            queue_pair: None,
        })
    }

    fn set_idle(&self, idle: bool) -> bool {
        lock(&self.slot.registry).set_idle(self.slot.id, idle)
    }

    /// Wait for the first byte of the next request: `false` when the client
    /// closed, stayed idle past `idle_timeout`, or the connection was
    /// closed for room. A landing's pin is dropped after `io_timeout` idle.
    fn wait_for_request(&mut self) -> bool {
        let (idle, io) = (self.options.idle_timeout, self.options.io_timeout);
        let since = Instant::now();
        if self.landing.is_some() {
            self.reader.get_mut().pace(idle.min(io), io);
            match self.reader.fill_buf() {
                Ok(got) => return !got.is_empty(),
                Err(e) if timed_out(&e) => self.landing = None,
                Err(_) => return false,
            }
        }
        self.reader.get_mut().pace(idle.saturating_sub(since.elapsed()), idle);
        matches!(self.reader.fill_buf(), Ok(got) if !got.is_empty())
    }

    fn reply(&mut self, response: &Response) -> io::Result<()> {
        self.writer
            .get_mut()
            .pace(reply_time(self.options, 0), self.options.io_timeout);
        send_json(&mut self.writer, FrameKind::Response, response).map_err(into_io)?;
        self.writer.flush()
    }

    fn run(&mut self) -> io::Result<()> {
        while self.wait_for_request() {
            if !self.set_idle(false) {
                return Ok(());
            }
            let io = self.options.io_timeout;
            self.reader.get_mut().pace(io, io);
            let request = match recv_json::<Request>(&mut self.reader, FrameKind::Request) {
                Ok(r) => r,
                // Past the deadline, or mid-frame: close.
                Err(WireError::Io(e)) => return Err(e),
                Err(e) => {
                    // A malformed frame leaves the stream unsynchronised: refuse and close.
                    let refusal = PeerRefusal::new(RefusalCode::Malformed, e.to_string());
                    return self.reply(&Response::Refused(refusal));
                }
            };
            match request {
                Request::Manifest {
                    adapter,
                    max_rank,
                    expert_rank,
                    placement,
                    transport,
                } => {
                    // A new manifest ends the connection's last landing.
                    self.landing = None;
                    let pinned = self
                        .store
                        .pinned_manifest(&adapter, max_rank, expert_rank, placement, transport);
                    let response = match pinned {
                        Ok((m, pin)) => {
                            self.landing = Some(Landing { pin, sent: 0 });
                            Response::Manifest(Box::new(m))
                        }
                        Err(r) => Response::Refused(r),
                    };
                    self.reply(&response)?;
                }
                Request::Read { ranges } => self.read(&ranges)?,
                Request::Connect { endpoint } => {
                    let response = self.connect(endpoint);
                    self.reply(&response)?;
                }
            }
            if !self.set_idle(true) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Answer a read: every range checked first, then the data frames; or
    /// one refusal and no data. Once the connection has sent every byte of
    /// its landing's staging, the landing is done and its pin dropped.
    fn read(&mut self, ranges: &[ReadRange]) -> io::Result<()> {
        if ranges.len() > MAX_READ_RANGES {
            let refusal = PeerRefusal::new(
                RefusalCode::TooManyRanges,
                format!("{} ranges, at most {MAX_READ_RANGES}", ranges.len()),
            );
            return self.reply(&Response::Refused(refusal));
        }
        let resolved = match self.store.resolve(ranges) {
            Ok(r) => r,
            Err(refusal) => return self.reply(&Response::Refused(refusal)),
        };
        let bytes = resolved.iter().map(|(_, r)| r.len() as u64).sum();
        let landed: u64 = match &self.landing {
            Some(l) => resolved
                .iter()
                .filter(|(staged, _)| staged.region == l.pin.region())
                .map(|(_, r)| r.len() as u64)
                .sum(),
            None => 0,
        };
        self.writer
            .get_mut()
            .pace(reply_time(self.options, bytes), self.options.io_timeout);
        for (staged, range) in resolved {
            let mut bytes = &staged.memory.bytes()[range];
            for len in data_frame_lens(bytes.len()) {
                let (frame, rest) = bytes.split_at(len);
                self.stall_if_due()?;
                self.write_data(frame)?;
                self.sent += len as u64;
                bytes = rest;
            }
        }
        self.writer.flush()?;
        if let Some(l) = &mut self.landing {
            l.sent = l.sent.saturating_add(landed);
            if l.sent >= l.pin.len() as u64 {
                self.landing = None;
            }
        }
        Ok(())
    }

    /// One data frame: small ones gather in the write buffer; one that does
    /// not fit goes out straight from the staging, its header with it in
    /// one vectored write.
    fn write_data(&mut self, payload: &[u8]) -> io::Result<()> {
        let room = self.writer.capacity() - self.writer.buffer().len();
        if HEADER_BYTES + payload.len() <= room {
            return write_frame(&mut self.writer, FrameKind::Data, payload).map_err(into_io);
        }
        self.writer.flush()?;
        write_frame_vectored(self.writer.get_mut(), FrameKind::Data, payload).map_err(into_io)
    }

    /// The test fault: once the data budget is spent, say so and hang.
    fn stall_if_due(&mut self) -> io::Result<()> {
        let Some(PeerFault::StallAfterBytes(limit)) = self.options.fault else {
            return Ok(());
        };
        if self.sent < limit {
            return Ok(());
        }
        self.writer.flush()?;
        let mut out = io::stdout().lock();
        writeln!(out, "lora-peer: stalled after {} data bytes", self.sent)?;
        out.flush()?;
        drop(out);
        loop {
            std::thread::park();
        }
    }

    #[cfg(feature = "ibverbs")]
    fn connect(&mut self, endpoint: crate::protocol::Endpoint) -> Response {
        let Some(device) = self.store.rdma() else {
            return Response::Refused(PeerRefusal::new(RefusalCode::NoRdma, "this peer serves no RDMA device"));
        };
        match device.accept(endpoint) {
            Ok(qp) => {
                let endpoint = qp.endpoint();
                self.queue_pair = Some(qp);
                Response::Connected { endpoint }
            }
            Err(e) => Response::Refused(PeerRefusal::new(RefusalCode::NoRdma, e.to_string())),
        }
    }

    #[cfg(not(feature = "ibverbs"))]
    fn connect(&mut self, _endpoint: crate::protocol::Endpoint) -> Response {
        Response::Refused(PeerRefusal::new(
            RefusalCode::NoRdma,
            "this peer was built without the ibverbs feature",
        ))
    }
}

fn into_io(e: WireError) -> io::Error {
    match e {
        WireError::Io(e) => e,
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

#[cfg(test)]
mod tests;
