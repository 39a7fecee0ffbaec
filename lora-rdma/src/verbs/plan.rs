//! RDMA READ planning: cut the landing ops into reads no longer than the
//! device's message limit, packed into batches that fit the registered
//! staging buffer and the queue's outstanding-request limit.

/// One landing op as RDMA sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteOp {
    /// Remote virtual address of the op's first byte.
    pub addr: u64,
    /// Remote key of its region.
    pub rkey: u32,
    /// Bytes.
    pub len: usize,
}

/// One RDMA READ work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRead {
    /// The op it serves.
    pub op: usize,
    /// Byte offset in the op's landing region.
    pub op_offset: usize,
    /// Remote address.
    pub remote_addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Byte offset in the local staging buffer.
    pub staging_offset: usize,
    /// Bytes (at most the message limit).
    pub len: usize,
}

/// Reads posted together, then copied out once all completed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadBatch {
    /// The reads, in staging order.
    pub reads: Vec<PlannedRead>,
    /// Staging bytes used.
    pub bytes: usize,
}

/// Limits a plan must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// The device's largest message (`ibv_port_attr::max_msg_sz`).
    pub max_message: usize,
    /// The registered staging buffer's size.
    pub staging_bytes: usize,
    /// Work requests in flight at once (send queue depth).
    pub max_outstanding: usize,
}

/// Why ops cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A limit is zero.
    #[error("RDMA plan limits must be positive: {0:?}")]
    ZeroLimit(PlanLimits),
    /// An op's remote range wraps the address space.
    #[error("op {op}: remote range {addr:#x}+{len} overflows")]
    AddressOverflow {
        /// The op.
        op: usize,
        /// Its address.
        addr: u64,
        /// Its length.
        len: usize,
    },
}

/// Plan every op's reads. Each read is at most
/// `min(max_message, staging_bytes)` bytes; each batch holds at most
/// `max_outstanding` reads and `staging_bytes` bytes; every op byte is read
/// exactly once, in order.
pub fn plan_reads(ops: &[RemoteOp], limits: PlanLimits) -> Result<Vec<ReadBatch>, PlanError> {
    if limits.max_message == 0 || limits.staging_bytes == 0 || limits.max_outstanding == 0 {
        return Err(PlanError::ZeroLimit(limits));
    }
    let piece_max = limits.max_message.min(limits.staging_bytes);
    let mut batches = Vec::new();
    let mut batch = ReadBatch::default();
    for (index, op) in ops.iter().enumerate() {
        let overflow = PlanError::AddressOverflow {
            op: index,
            addr: op.addr,
            len: op.len,
        };
        u64::try_from(op.len)
            .ok()
            .and_then(|len| op.addr.checked_add(len))
            .ok_or(overflow.clone())?;
        let mut done = 0usize;
        while done < op.len {
            let room = limits.staging_bytes - batch.bytes;
            if room == 0 || batch.reads.len() == limits.max_outstanding {
                batches.push(std::mem::take(&mut batch));
                continue;
            }
            let len = (op.len - done).min(piece_max).min(room);
            batch.reads.push(PlannedRead {
                op: index,
                op_offset: done,
                remote_addr: op.addr + done as u64,
                rkey: op.rkey,
                staging_offset: batch.bytes,
                len,
            });
            batch.bytes += len;
            done += len;
        }
    }
    if !batch.reads.is_empty() {
        batches.push(batch);
    }
    Ok(batches)
}

#[cfg(test)]
mod tests;
