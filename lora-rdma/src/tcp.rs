//! The TCP transport: the peer protocol's data frames on the control
//! connection, for hosts without RDMA and for tests.
//!
//! Reads are batched ([`MAX_READ_RANGES`] ranges per request), and every
//! data frame is read straight into its landing region: the frame lengths
//! are fixed by the engine's own op lengths ([`data_frame_lens`]), so a
//! frame of any other length is refused before a byte of it is read. Once a
//! range is whole, the sink is told ([`LandingSink::landed`]) so it can
//! check it while the next range arrives. The socket's read timeout is set
//! only when the wait changes (near the call's deadline), not before every
//! read.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use lora_audit::LoraOptions;

use crate::manifest::{Location, Manifest, WirePlacement};
use crate::protocol::{MAX_READ_RANGES, ReadRange, Request, Response, TransportKind, data_frame_lens};
use crate::transport::{LandingSink, ReadOp, Transport, TransportError, sink_region};
use crate::wire::{FrameKind, WireError, read_header, recv_json, send_json};

/// Socket settings of the engine side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpOptions {
    /// Limit on establishing the connection.
    pub connect_timeout: Duration,
    /// Limit on any single read or write: a peer silent for longer is dead.
    pub io_timeout: Duration,
    /// The slowest a landing may be, bytes per second: every call has an
    /// overall deadline of `2 * io_timeout + bytes / min_rate` (a control
    /// reply: `2 * io_timeout`), so a peer that trickles bytes just inside
    /// `io_timeout` cannot hold a landing.
    pub min_rate: u64,
}

/// The default [`TcpOptions::min_rate`]: 16 MiB/s.
pub const DEFAULT_MIN_RATE: u64 = 16 << 20;

impl Default for TcpOptions {
    fn default() -> TcpOptions {
        TcpOptions {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            min_rate: DEFAULT_MIN_RATE,
        }
    }
}

/// A reader that enforces an overall deadline: each read waits at most
/// the time left (and at most `io_timeout`).
struct Paced<'a> {
    reader: &'a mut BufReader<TcpStream>,
    /// The socket's read timeout as last set: a read whose wait is
    /// unchanged (`io_timeout`, while more than that is left) makes no
    /// `setsockopt` call.
    timeout_set: &'a mut Option<Duration>,
    deadline: Instant,
    io_timeout: Duration,
}

impl Read for Paced<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.reader.buffer().is_empty() {
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the call's deadline passed",
                ));
            }
            let wait = Some(left.min(self.io_timeout));
            if *self.timeout_set != wait {
                self.reader.get_ref().set_read_timeout(wait)?;
                *self.timeout_set = wait;
            }
        }
        self.reader.read(buf)
    }
}

/// A control connection to a weight peer that also carries the data.
pub struct TcpTransport {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
    timeout: Duration,
    min_rate: u64,
    /// Why the connection is out of protocol sync, once it is: every later
    /// call is refused with it (reconnect to land again).
    broken: Option<String>,
    /// The deadline of the call in progress, and how long it was given.
    deadline: (Instant, Duration),
    /// The socket's read timeout as last set.
    read_timeout: Option<Duration>,
}

impl TcpTransport {
    /// Connect to `addr` (`host:port`).
    pub fn connect(addr: &str, options: TcpOptions) -> Result<TcpTransport, TransportError> {
        let connect_err = |source| TransportError::Connect {
            addr: addr.to_string(),
            source,
        };
        let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(connect_err)?.collect();
        let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, "the address resolves to nothing");
        for sock in addrs {
            match TcpStream::connect_timeout(&sock, options.connect_timeout) {
                Ok(stream) => {
                    let mut t = TcpTransport::from_stream(stream, options.io_timeout).map_err(connect_err)?;
                    t.min_rate = options.min_rate.max(1);
                    return Ok(t);
                }
                Err(e) => last = e,
            }
        }
        Err(connect_err(last))
    }

    /// Connect to the peer the serving options name (`LORA_PEER`, read by
    /// `LoraOptions::from_env`).
    pub fn connect_configured(opts: &LoraOptions, options: TcpOptions) -> Result<TcpTransport, TransportError> {
        let addr = opts.peer.as_deref().ok_or(TransportError::NoPeer)?;
        TcpTransport::connect(addr, options)
    }

    /// Wrap a connected stream, setting its timeouts.
    pub fn from_stream(stream: TcpStream, io_timeout: Duration) -> std::io::Result<TcpTransport> {
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        stream.set_nodelay(true)?;
        Ok(TcpTransport {
            reader: BufReader::with_capacity(1 << 16, stream.try_clone()?),
            writer: BufWriter::new(stream),
            timeout: io_timeout,
            min_rate: DEFAULT_MIN_RATE,
            broken: None,
            deadline: (Instant::now() + io_timeout, io_timeout),
            read_timeout: Some(io_timeout),
        })
    }

    fn wire(&self, e: WireError) -> TransportError {
        if Instant::now() >= self.deadline.0 {
            return TransportError::Deadline(self.deadline.1);
        }
        TransportError::from_wire(e, self.timeout)
    }

    /// Start a call that moves `bytes` of data: refused on a broken
    /// connection; sets the call's overall deadline.
    pub(crate) fn begin(&mut self, bytes: usize) -> Result<(), TransportError> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Broken(why.clone()));
        }
        let for_bytes = Duration::from_secs_f64(bytes as f64 / self.min_rate as f64);
        // Twice the per-read limit: a silent peer is a Timeout first.
        let total = self.timeout.saturating_mul(2).saturating_add(for_bytes);
        self.deadline = (Instant::now() + total, total);
        Ok(())
    }

    /// Mark the connection out of sync after `e` (a refusal at a frame
    /// boundary leaves it in sync), and pass `e` on.
    fn fail(&mut self, e: TransportError) -> TransportError {
        if !matches!(e, TransportError::Refused(_)) && self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        e
    }

    fn paced(&mut self) -> Paced<'_> {
        Paced {
            reader: &mut self.reader,
            timeout_set: &mut self.read_timeout,
            deadline: self.deadline.0,
            io_timeout: self.timeout,
        }
    }

    /// After the last frame of a read: anything more already sent is out
    /// of protocol order.
    fn check_no_extra_frame(&mut self) -> Result<(), TransportError> {
        let mut extra = !self.reader.buffer().is_empty();
        if !extra {
            let stream = self.reader.get_ref();
            stream.set_nonblocking(true).map_err(|e| self.wire(WireError::Io(e)))?;
            let mut one = [0u8; 1];
            extra = matches!(stream.peek(&mut one), Ok(n) if n > 0);
            stream.set_nonblocking(false).map_err(|e| self.wire(WireError::Io(e)))?;
        }
        if extra {
            return Err(TransportError::Protocol(
                "the peer sent more after the last data frame of a read".into(),
            ));
        }
        Ok(())
    }

    /// Send one request and flush it.
    pub(crate) fn send(&mut self, request: &Request) -> Result<(), TransportError> {
        send_json(&mut self.writer, FrameKind::Request, request).map_err(|e| self.wire(e))?;
        self.writer.flush().map_err(|e| self.wire(WireError::Io(e)))
    }

    /// Read one control reply; a refusal becomes [`TransportError::Refused`].
    pub(crate) fn reply(&mut self) -> Result<Response, TransportError> {
        let got = recv_json(&mut self.paced(), FrameKind::Response);
        match got.map_err(|e| self.wire(e)).map_err(|e| self.fail(e))? {
            Response::Refused(r) => Err(TransportError::Refused(r)),
            other => Ok(other),
        }
    }

    /// Ask for a manifest whose locations suit `transport`.
    pub(crate) fn manifest_for(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
        transport: TransportKind,
    ) -> Result<Manifest, TransportError> {
        self.begin(0)?;
        self.send(&Request::Manifest {
            adapter: adapter.to_string(),
            max_rank,
            expert_rank,
            placement,
            transport,
        })?;
        match self.reply()? {
            Response::Manifest(m) => Ok(*m),
            other => Err(TransportError::Protocol(format!(
                "{other:?} where a manifest was expected"
            ))),
        }
    }

    /// Read the data frames of one range into `dst`. The peer may answer
    /// the first frame of a request with a refusal instead.
    fn read_range(&mut self, dst: &mut [u8]) -> Result<(), TransportError> {
        let mut rest = dst;
        for want in data_frame_lens(rest.len()) {
            let (kind, len) = read_header(&mut self.paced()).map_err(|e| self.wire(e))?;
            match kind {
                FrameKind::Data if len == want => {
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(want);
                    self.paced().read_exact(head).map_err(|e| self.wire(WireError::Io(e)))?;
                    rest = tail;
                }
                FrameKind::Data => {
                    return Err(TransportError::Wire(WireError::Malformed {
                        kind,
                        reason: format!("data frame of {len} bytes where {want} were asked for"),
                    }));
                }
                FrameKind::Response => {
                    let mut payload = vec![0u8; len];
                    self.paced()
                        .read_exact(&mut payload)
                        .map_err(|e| self.wire(WireError::Io(e)))?;
                    return Err(match serde_json::from_slice::<Response>(&payload) {
                        Ok(Response::Refused(r)) => TransportError::Refused(r),
                        Ok(other) => TransportError::Protocol(format!("{other:?} where data was expected")),
                        Err(e) => TransportError::Wire(WireError::Malformed {
                            kind,
                            reason: e.to_string(),
                        }),
                    });
                }
                FrameKind::Request => {
                    return Err(TransportError::Wire(WireError::UnexpectedKind {
                        expected: FrameKind::Data,
                        got: kind,
                    }));
                }
            }
        }
        Ok(())
    }
}

/// The peer's region range of each op, refusing locations of another
/// transport.
fn tcp_ranges(ops: &[ReadOp]) -> Result<Vec<ReadRange>, TransportError> {
    ops.iter()
        .enumerate()
        .map(|(index, op)| match op.location {
            Location::Tcp { region, offset } => Ok(ReadRange {
                region,
                offset,
                len: op.len as u64,
            }),
            location => Err(TransportError::Location {
                index,
                location,
                kind: TransportKind::Tcp,
            }),
        })
        .collect()
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn fetch_manifest(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
    ) -> Result<Manifest, TransportError> {
        self.manifest_for(adapter, max_rank, expert_rank, placement, TransportKind::Tcp)
    }

    fn read(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError> {
        let ranges = tcp_ranges(ops)?;
        let bytes = ops.iter().fold(0usize, |a, op| a.saturating_add(op.len));
        self.begin(bytes)?;
        for (batch, chunk) in ranges.chunks(MAX_READ_RANGES).enumerate() {
            self.send(&Request::Read { ranges: chunk.to_vec() })
                .map_err(|e| self.fail(e))?;
            for (i, range) in chunk.iter().enumerate() {
                let index = batch * MAX_READ_RANGES + i;
                let dst = sink_region(sink, index, range.len as usize)?;
                // A refusal mid-read leaves the peer's remaining frames unread.
                self.read_range(dst).map_err(|e| match e {
                    TransportError::Refused(r) => {
                        self.broken = Some(format!("the peer refused mid-read: {r}"));
                        TransportError::Refused(r)
                    }
                    other => self.fail(other),
                })?;
                sink.landed(index);
            }
        }
        self.check_no_extra_frame().map_err(|e| self.fail(e))
    }
}

#[cfg(test)]
mod tests;
