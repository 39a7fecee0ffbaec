//! The peer protocol's messages, carried as JSON in [`crate::wire`] control
//! frames.
//!
//! One TCP connection carries a sequence of request/reply exchanges:
//!
//! - [`Request::Manifest`] → [`Response::Manifest`] or [`Response::Refused`];
//! - [`Request::Read`] → one or more data frames per range, in request order,
//!   each range cut by [`data_frame_lens`]; or, when any range is refused,
//!   a single [`Response::Refused`] and no data at all;
//! - [`Request::Connect`] (verbs only) → [`Response::Connected`]: the two
//!   RC queue-pair endpoints; after it, the engine reads with RDMA READ.
//!
//! Everything here is a plain wire value; the receiving side bounds every
//! number before it is used.

use serde::{Deserialize, Serialize};

use crate::manifest::{Manifest, WirePlacement};
use crate::wire::MAX_DATA_BYTES;

/// The most ranges one [`Request::Read`] may carry. A range encodes to at
/// most 80 JSON bytes, so a full request (2.6 MB) fits one
/// [`crate::wire::MAX_CONTROL_BYTES`] frame.
pub const MAX_READ_RANGES: usize = 1 << 15;

/// The most bytes one [`Request::Read`] may ask for, summed over its
/// ranges. A peer also refuses a read asking for more bytes than the
/// regions it names hold (a correct engine reads each staged byte once), so
/// a small request cannot make it stream the same region over and over; and
/// it refuses to stage anything larger, so one landing always fits.
pub const MAX_READ_BYTES: u64 = 16 << 30;

/// The largest rank (dense `max_rank` or `expert_rank`) a peer stages for.
pub const MAX_STAGED_RANK: u32 = 4096;

/// How the engine will read the staged bytes; decides the manifest's
/// [`crate::manifest::Location`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransportKind {
    /// Data frames on the control connection.
    Tcp,
    /// RDMA READ from registered peer memory.
    Rdma,
}

/// One byte range of a peer staging region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRange {
    /// The staging region.
    pub region: u32,
    /// Byte offset in it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl ReadRange {
    /// `offset..offset + len` inside a region of `region_len` bytes, or
    /// `None` when any part of it lies outside (or the end overflows).
    pub fn within(&self, region_len: usize) -> Option<std::ops::Range<usize>> {
        let start = usize::try_from(self.offset).ok()?;
        let end = start.checked_add(usize::try_from(self.len).ok()?)?;
        (end <= region_len).then_some(start..end)
    }
}

/// A queue pair's address for the RC connection, exchanged over TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// The port GID (RoCE needs it for the global route header).
    pub gid: [u8; 16],
    /// The port's active MTU as the verbs enum value (1 = 256 .. 5 = 4096).
    pub mtu: u8,
    /// RDMA READs this side keeps in flight (engine) or accepts in flight
    /// (peer); the engine uses the smaller of the two.
    pub rd_atomic: u8,
}

/// Why an [`Endpoint`] from the wire cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// QP number or PSN wider than 24 bits.
    #[error("endpoint {field} {value:#x} does not fit 24 bits")]
    Wide {
        /// `qpn` or `psn`.
        field: &'static str,
        /// The value.
        value: u32,
    },
    /// QP number 0 or 1 (reserved for management QPs).
    #[error("endpoint QP number {0} is reserved")]
    ReservedQp(u32),
    /// MTU outside the verbs enum.
    #[error("endpoint MTU code {0} is not 1..=5")]
    Mtu(u8),
    /// No RDMA READ may be in flight.
    #[error("endpoint allows {0} RDMA READs in flight; at least 1 is needed")]
    RdAtomic(u8),
}

impl Endpoint {
    /// Check every field's range.
    pub fn validate(&self) -> Result<(), EndpointError> {
        for (field, value) in [("qpn", self.qpn), ("psn", self.psn)] {
            if value >= 1 << 24 {
                return Err(EndpointError::Wide { field, value });
            }
        }
        if self.qpn < 2 {
            return Err(EndpointError::ReservedQp(self.qpn));
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(EndpointError::Mtu(self.mtu));
        }
        if self.rd_atomic == 0 {
            return Err(EndpointError::RdAtomic(0));
        }
        Ok(())
    }
}

/// An engine's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Stage `adapter` for this geometry (if not yet) and send its manifest.
    Manifest {
        /// The adapter's name at the peer.
        adapter: String,
        /// The engine's slot-pool `max_rank`.
        max_rank: u32,
        /// The engine's expert-pool rank.
        expert_rank: u32,
        /// The engine pool's tensor- and expert-parallel rank and its cut
        /// options: the peer stages and lists only that rank's bytes of
        /// each pair, cut as the rank's layout cuts them.
        placement: WirePlacement,
        /// Which locations the manifest should give.
        transport: TransportKind,
    },
    /// Send these staged byte ranges as data frames.
    Read {
        /// The ranges, answered in order.
        ranges: Vec<ReadRange>,
    },
    /// Connect an RC queue pair to this endpoint (verbs transport).
    Connect {
        /// The engine's queue pair.
        endpoint: Endpoint,
    },
}

/// Why the peer refused a request; the connection stays usable unless the
/// request itself was malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalCode {
    /// The peer serves no adapter of that name (unknown, or refused by its
    /// own audit at startup).
    UnknownAdapter,
    /// The requested `max_rank` / `expert_rank` is below the adapter's rank,
    /// zero, or above [`MAX_STAGED_RANK`].
    Rank,
    /// Staging failed (the adapter changed on disk, memory budget, ...).
    Staging,
    /// The requested placement names no rank (a zero world, a rank past
    /// its world, an unknown flag bit) or does not divide the model's
    /// geometry.
    Placement,
    /// A read names an unknown region or leaves its region.
    BadRead,
    /// A read carries more than [`MAX_READ_RANGES`] ranges.
    TooManyRanges,
    /// A read asks for more than [`MAX_READ_BYTES`] bytes, or for more
    /// bytes than the regions it names hold.
    TooManyBytes,
    /// The peer has no RDMA device, or the connection has no queue pair.
    NoRdma,
    /// The peer is at its connection limit (overall or for this client),
    /// or its staging memory is held by active landings; try again later.
    Busy,
    /// The request could not be decoded.
    Malformed,
}

/// A refusal frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("peer refused ({code:?}): {message}")]
pub struct PeerRefusal {
    /// The stable code.
    pub code: RefusalCode,
    /// The peer's explanation.
    pub message: String,
}

impl PeerRefusal {
    /// A refusal with `code` and `message`.
    pub fn new(code: RefusalCode, message: impl Into<String>) -> PeerRefusal {
        PeerRefusal {
            code,
            message: message.into(),
        }
    }
}

/// A peer's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// The staged adapter's manifest.
    Manifest(Box<Manifest>),
    /// The peer's queue pair, connected to the engine's.
    Connected {
        /// The peer's endpoint.
        endpoint: Endpoint,
    },
    /// The request was refused.
    Refused(PeerRefusal),
}

/// The payload lengths of the data frames that carry a range of `len`
/// bytes: full [`MAX_DATA_BYTES`] frames, then the remainder (none for an
/// empty range). Peer and engine both cut ranges with this.
pub fn data_frame_lens(len: usize) -> impl Iterator<Item = usize> {
    let max = MAX_DATA_BYTES as usize;
    (0..len.div_ceil(max)).map(move |i| max.min(len - i * max))
}

#[cfg(test)]
mod tests;
