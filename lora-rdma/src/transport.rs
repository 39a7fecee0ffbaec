//! The engine side's view of a peer: fetch a manifest, then read checked
//! byte ranges straight into landing regions. [`crate::tcp::TcpTransport`]
//! and, under the `ibverbs` feature, `crate::verbs::VerbsTransport`
//! implement it.

use std::io;
use std::time::Duration;

use lora_pool::image::ImageError;

use crate::manifest::{Location, Manifest, WirePlacement};
use crate::protocol::{PeerRefusal, TransportKind};
use crate::wire::WireError;

/// One read the lander asks for: `len` bytes at `location`, landing in the
/// region the sink hands out for its index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOp {
    /// Where the peer keeps the bytes.
    pub location: Location,
    /// Bytes, from the engine's own layout.
    pub len: usize,
}

/// Where landed bytes go: the region of op `index`, exactly `ops[index].len`
/// bytes long. A transport asks for each region once, fills it completely,
/// and never keeps it past the next call.
pub trait LandingSink {
    /// The landing region of op `index`.
    fn region(&mut self, index: usize) -> Result<&mut [u8], TransportError>;

    /// Op `index`'s region is filled: the transport will not write it again
    /// unless it asks for it again. A transport that fills a region in one
    /// piece says so right away, and the sink may check the bytes while
    /// they are still in cache and the next region's bytes arrive; one that
    /// does not call it loses nothing but that overlap (the lander checks
    /// every region it was not told about, and every region handed out
    /// again after it was told, once the read returns).
    fn landed(&mut self, index: usize) {
        let _ = index;
    }
}

/// How the engine talks to a weight peer.
pub trait Transport {
    /// Which locations this transport reads.
    fn kind(&self) -> TransportKind;

    /// Ask the peer to stage `adapter` for this geometry and rank and
    /// return its manifest, unchecked (see [`crate::land::Lander::check`]).
    fn fetch_manifest(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
    ) -> Result<Manifest, TransportError>;

    /// Land every op: fill `sink.region(i)` with the `ops[i].len` bytes at
    /// `ops[i].location`. On error, the regions handed out so far may hold
    /// partial data; the caller discards them.
    fn read(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError>;
}

/// A transport failure.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// No peer is configured (`LORA_PEER` unset).
    #[error("no weight peer is configured (LORA_PEER)")]
    NoPeer,
    /// The peer could not be reached.
    #[error("cannot connect to peer {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// The cause.
        source: io::Error,
    },
    /// The peer went silent for longer than the timeout.
    #[error("peer did not answer within {0:?}")]
    Timeout(Duration),
    /// The call did not finish within its overall deadline (the peer is
    /// slower than the transport's minimum rate).
    #[error("the peer did not finish within the call's deadline of {0:?}")]
    Deadline(Duration),
    /// The connection fell out of protocol sync earlier (a malformed or
    /// extra frame, a timeout mid-frame): reconnect.
    #[error("the peer connection is out of protocol sync: {0}")]
    Broken(String),
    /// The peer closed or reset the connection (it died or gave up).
    #[error("peer connection lost: {0}")]
    Disconnected(io::Error),
    /// A frame was malformed, oversized, of another version or kind.
    #[error(transparent)]
    Wire(WireError),
    /// The peer refused the request.
    #[error(transparent)]
    Refused(PeerRefusal),
    /// The peer answered with a message the protocol does not allow here.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A location of another transport.
    #[error("op {index}: a {location:?} location cannot be read by the {kind:?} transport")]
    Location {
        /// The op.
        index: usize,
        /// Its location.
        location: Location,
        /// This transport.
        kind: TransportKind,
    },
    /// A transport asked the sink for an op that does not exist.
    #[error("no landing op {0}")]
    NoSuchOp(usize),
    /// The landing sink refused a region.
    #[error("landing region: {0}")]
    Landing(#[from] ImageError),
    /// The sink's region has another length than the op.
    #[error("op {index}: landing region is {got} bytes, the op reads {expected}")]
    RegionLength {
        /// The op.
        index: usize,
        /// The region's length.
        got: usize,
        /// The op's.
        expected: usize,
    },
    /// The RDMA transport failed.
    #[cfg(feature = "ibverbs")]
    #[error(transparent)]
    Verbs(#[from] crate::verbs::VerbsError),
}

impl TransportError {
    /// Sort a wire error: timeouts and lost connections get their own
    /// variants, so callers can tell a dead peer from a malformed frame.
    pub fn from_wire(e: WireError, timeout: Duration) -> TransportError {
        match e {
            WireError::Io(io) => match io.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransportError::Timeout(timeout),
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => TransportError::Disconnected(io),
                _ => TransportError::Wire(WireError::Io(io)),
            },
            other => TransportError::Wire(other),
        }
    }
}

/// The region of op `index`, checked to be exactly `len` bytes.
pub(crate) fn sink_region(sink: &mut dyn LandingSink, index: usize, len: usize) -> Result<&mut [u8], TransportError> {
    let region = sink.region(index)?;
    if region.len() != len {
        return Err(TransportError::RegionLength {
            index,
            got: region.len(),
            expected: len,
        });
    }
    Ok(region)
}
