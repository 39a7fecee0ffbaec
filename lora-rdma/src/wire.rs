//! The peer protocol's framing: versioned, length-prefixed frames with a hard
//! size limit per frame kind.
//!
//! ```text
//! magic  "LRDM"   4 bytes
//! version u16 LE  PROTOCOL_VERSION
//! kind    u16 LE  FrameKind
//! len     u32 LE  payload bytes (<= the kind's limit)
//! payload         JSON for control frames, raw bytes for data frames
//! ```
//!
//! A length over the limit is refused before anything is allocated or read.

use std::io::{self, IoSlice, Read, Write};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"LRDM";
/// The protocol version this build speaks; frames of any other version are
/// refused. Version 2: a manifest request names the engine's placement
/// (ranks, worlds and the cut-option flags of
/// [`crate::manifest::WirePlacement`]), a manifest lists the rank's bytes
/// and DoRA magnitudes ([`crate::manifest::WirePart::Magnitude`]).
pub const PROTOCOL_VERSION: u16 = 2;
/// Largest request frame (what a peer accepts from an engine).
pub const MAX_CONTROL_BYTES: u32 = 4 << 20;
/// Largest response frame (what an engine accepts from a peer): a manifest
/// lists every staged part with the adapter's tensor header, about 150
/// bytes a part and 100 a tensor in JSON, so an adapter of every routed
/// expert of a large MoE (Qwen3-30B-A3B: 37k parts; DeepSeek-V3: 89k) needs
/// several MiB to a few tens of MiB.
pub const MAX_RESPONSE_BYTES: u32 = 64 << 20;
/// Largest data frame; larger reads are answered in several frames.
pub const MAX_DATA_BYTES: u32 = 8 << 20;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 12;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A JSON request from the engine.
    Request,
    /// A JSON response from the peer.
    Response,
    /// Raw bytes answering a read.
    Data,
}

impl FrameKind {
    fn code(self) -> u16 {
        match self {
            FrameKind::Request => 1,
            FrameKind::Response => 2,
            FrameKind::Data => 3,
        }
    }

    fn from_code(code: u16) -> Option<FrameKind> {
        match code {
            1 => Some(FrameKind::Request),
            2 => Some(FrameKind::Response),
            3 => Some(FrameKind::Data),
            _ => None,
        }
    }

    /// The largest payload a frame of this kind may carry.
    pub fn limit(self) -> u32 {
        match self {
            FrameKind::Request => MAX_CONTROL_BYTES,
            FrameKind::Response => MAX_RESPONSE_BYTES,
            FrameKind::Data => MAX_DATA_BYTES,
        }
    }
}

/// A malformed or unexpected frame.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed mid-frame.
    #[error("peer connection: {0}")]
    Io(#[from] io::Error),
    /// The frame does not start with the magic.
    #[error("not a peer-protocol frame (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// The frame speaks another protocol version.
    #[error("peer speaks protocol version {got}, this build speaks {PROTOCOL_VERSION}")]
    Version {
        /// The frame's version.
        got: u16,
    },
    /// The frame kind is unknown.
    #[error("unknown frame kind {0}")]
    UnknownKind(u16),
    /// Another frame kind was expected here.
    #[error("expected a {expected:?} frame, got {got:?}")]
    UnexpectedKind {
        /// What the protocol expected.
        expected: FrameKind,
        /// What arrived.
        got: FrameKind,
    },
    /// The frame is larger than its kind allows.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {limit}")]
    Oversized {
        /// The frame kind.
        kind: FrameKind,
        /// Its announced length.
        len: u64,
        /// The limit.
        limit: u32,
    },
    /// A control payload is not valid JSON for its message type.
    #[error("malformed {kind:?} payload: {reason}")]
    Malformed {
        /// The frame kind.
        kind: FrameKind,
        /// The decoder's message.
        reason: String,
    },
}

/// The header of a frame of `kind` carrying `len` payload bytes, refused
/// over the kind's limit.
pub fn frame_header(kind: FrameKind, len: usize) -> Result<[u8; HEADER_BYTES], WireError> {
    let len32 = u32::try_from(len)
        .ok()
        .filter(|&l| l <= kind.limit())
        .ok_or(WireError::Oversized {
            kind,
            len: len as u64,
            limit: kind.limit(),
        })?;
    let mut header = [0u8; HEADER_BYTES];
    header[..4].copy_from_slice(&MAGIC);
    header[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    header[6..8].copy_from_slice(&kind.code().to_le_bytes());
    header[8..12].copy_from_slice(&len32.to_le_bytes());
    Ok(header)
}

/// Write one frame.
pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> Result<(), WireError> {
    let header = frame_header(kind, payload.len())?;
    w.write_all(&header)?;
    w.write_all(payload)?;
    Ok(())
}

/// Write one frame as [`write_frame`] does, header and payload handed to
/// the writer together (`write_vectored`): on a socket, a large data frame
/// leaves in one system call instead of a 12-byte one for the header and
/// another for the payload, and its header does not travel as a segment of
/// its own. The bytes written are the same.
pub fn write_frame_vectored(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> Result<(), WireError> {
    let header = frame_header(kind, payload.len())?;
    let mut slices = [IoSlice::new(&header), IoSlice::new(payload)];
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    while !rest.is_empty() {
        match w.write_vectored(rest) {
            Ok(0) => return Err(WireError::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Io(e)),
        }
    }
    Ok(())
}

/// Read one frame header; returns its kind and payload length, checked
/// against the kind's limit.
pub fn read_header(r: &mut impl Read) -> Result<(FrameKind, usize), WireError> {
    let mut header = [0u8; HEADER_BYTES];
    r.read_exact(&mut header)?;
    let magic = [header[0], header[1], header[2], header[3]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::Version { got: version });
    }
    let code = u16::from_le_bytes([header[6], header[7]]);
    let kind = FrameKind::from_code(code).ok_or(WireError::UnknownKind(code))?;
    let len = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    if len > kind.limit() {
        return Err(WireError::Oversized {
            kind,
            len: u64::from(len),
            limit: kind.limit(),
        });
    }
    Ok((kind, len as usize))
}

/// Read one whole frame of kind `expected`.
pub fn read_frame(r: &mut impl Read, expected: FrameKind) -> Result<Vec<u8>, WireError> {
    let (kind, len) = read_header(r)?;
    if kind != expected {
        return Err(WireError::UnexpectedKind { expected, got: kind });
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(payload)
}

/// Read the payload of a data frame straight into `dst`, which must be
/// exactly as long as the frame announces.
pub fn read_data_into(r: &mut impl Read, dst: &mut [u8]) -> Result<(), WireError> {
    let (kind, len) = read_header(r)?;
    if kind != FrameKind::Data {
        return Err(WireError::UnexpectedKind {
            expected: FrameKind::Data,
            got: kind,
        });
    }
    if len != dst.len() {
        return Err(WireError::Malformed {
            kind,
            reason: format!("data frame of {len} bytes where {} were asked for", dst.len()),
        });
    }
    r.read_exact(dst)?;
    Ok(())
}

/// Serialise a control message into a frame.
pub fn send_json<T: serde::Serialize>(w: &mut impl Write, kind: FrameKind, msg: &T) -> Result<(), WireError> {
    let payload = serde_json::to_vec(msg).map_err(|e| WireError::Malformed {
        kind,
        reason: e.to_string(),
    })?;
    write_frame(w, kind, &payload)
}

/// Read and decode a control message.
pub fn recv_json<T: serde::de::DeserializeOwned>(r: &mut impl Read, kind: FrameKind) -> Result<T, WireError> {
    let payload = read_frame(r, kind)?;
    serde_json::from_slice(&payload).map_err(|e| WireError::Malformed {
        kind,
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests;
