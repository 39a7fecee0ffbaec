//! The peer's TCP server: one thread per connection, a bounded number of
//! connections, request/reply exchanges of the peer protocol.

use std::io::{self, BufReader, BufWriter, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::peer::store::PeerStore;
use crate::protocol::{MAX_READ_RANGES, PeerRefusal, ReadRange, RefusalCode, Request, Response, data_frame_lens};
use crate::wire::{FrameKind, WireError, recv_json, send_json, write_frame};

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
    /// Connections served at once; more are refused with
    /// [`RefusalCode::Busy`].
    pub max_connections: usize,
    /// A connection silent for longer is closed.
    pub idle_timeout: Duration,
    /// Test only: a deliberate fault.
    pub fault: Option<PeerFault>,
}

impl Default for PeerOptions {
    fn default() -> PeerOptions {
        PeerOptions {
            max_connections: 32,
            idle_timeout: Duration::from_secs(300),
            fault: None,
        }
    }
}

/// A weight peer: a [`PeerStore`] behind a listening socket.
pub struct Peer {
    store: Arc<PeerStore>,
    listener: TcpListener,
    options: PeerOptions,
    active: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

/// Decrements the connection count when a connection thread ends, however
/// it ends.
struct ConnectionSlot(Arc<AtomicUsize>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
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
            active: Arc::new(AtomicUsize::new(0)),
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
            if self.active.fetch_add(1, Ordering::AcqRel) >= self.options.max_connections {
                drop(ConnectionSlot(Arc::clone(&self.active)));
                refuse_busy(stream);
                continue;
            }
            let slot = ConnectionSlot(Arc::clone(&self.active));
            let store = Arc::clone(&self.store);
            let options = self.options.clone();
            let spawned = std::thread::Builder::new()
                .name("lora-peer-conn".into())
                .spawn(move || {
                    let _slot = slot;
                    // A connection's failure is the engine's to report.
                    let _ = Connection::new(&store, stream, &options).and_then(|mut c| c.run());
                });
            if spawned.is_err() {
                continue;
            }
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

fn refuse_busy(stream: TcpStream) {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let mut w = BufWriter::new(stream);
    let busy = Response::Refused(PeerRefusal::new(
        RefusalCode::Busy,
        "the peer is at its connection limit",
    ));
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
    /// end when their engine disconnects).
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

/// One engine connection.
struct Connection<'a> {
    store: &'a PeerStore,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    fault: Option<PeerFault>,
    sent: u64,
    #[cfg(feature = "ibverbs")]
    queue_pair: Option<crate::verbs::PeerQueuePair>,
}

impl<'a> Connection<'a> {
    fn new(store: &'a PeerStore, stream: TcpStream, options: &PeerOptions) -> io::Result<Connection<'a>> {
        stream.set_read_timeout(Some(options.idle_timeout))?;
        stream.set_write_timeout(Some(options.idle_timeout))?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            store,
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::with_capacity(1 << 16, stream),
            fault: options.fault,
            sent: 0,
            #[cfg(feature = "ibverbs")]
            queue_pair: None,
        })
    }

    fn reply(&mut self, response: &Response) -> io::Result<()> {
        send_json(&mut self.writer, FrameKind::Response, response).map_err(into_io)?;
        self.writer.flush()
    }

    fn run(&mut self) -> io::Result<()> {
        loop {
            let request = match recv_json::<Request>(&mut self.reader, FrameKind::Request) {
                Ok(r) => r,
                Err(WireError::Io(e)) => {
                    return match e.kind() {
                        io::ErrorKind::UnexpectedEof => Ok(()),
                        _ => Err(e),
                    };
                }
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
                    transport,
                } => {
                    let response = match self.store.manifest(&adapter, max_rank, expert_rank, transport) {
                        Ok(m) => Response::Manifest(Box::new(m)),
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
        }
    }

    /// Answer a read: every range checked first, then the data frames; or
    /// one refusal and no data.
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
        for (staged, range) in resolved {
            let mut bytes = &staged.memory.bytes()[range];
            for len in data_frame_lens(bytes.len()) {
                let (frame, rest) = bytes.split_at(len);
                self.stall_if_due()?;
                write_frame(&mut self.writer, FrameKind::Data, frame).map_err(into_io)?;
                self.sent += len as u64;
                bytes = rest;
            }
        }
        self.writer.flush()
    }

    /// The test fault: once the data budget is spent, say so and hang.
    fn stall_if_due(&mut self) -> io::Result<()> {
        let Some(PeerFault::StallAfterBytes(limit)) = self.fault else {
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
