//! The RDMA READ transport (engine side) and the peer's device (responder
//! side). The TCP control connection carries the manifest and the queue
//! pair endpoints; the data moves by RDMA READ from the peer's remote-read
//! regions into the engine's registered staging buffer, then into the
//! landing images.

use std::sync::Arc;
use std::time::Duration;

use crate::manifest::{Location, Manifest, WirePlacement};
use crate::protocol::{Endpoint, Request, Response, TransportKind};
use crate::tcp::{TcpOptions, TcpTransport};
use crate::transport::{LandingSink, ReadOp, Transport, TransportError, sink_region};
use crate::verbs::device::{CompletionQueue, Context, ProtectionDomain, QpRole, QueuePair, ReadWr, RegisteredBytes};
use crate::verbs::plan::{PlanLimits, RemoteOp, plan_reads};
use crate::verbs::{MemoryRole, VerbsError, access_for};

/// Engine-side settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsOptions {
    /// The RDMA device (`mlx5_0`, `rxe0`, ...).
    pub device: String,
    /// Its port (1-based).
    pub port: u8,
    /// GID index on that port (RoCE).
    pub gid_index: u8,
    /// Size of the registered landing staging buffer.
    pub staging_bytes: usize,
    /// RDMA READs in flight per batch.
    pub queue_depth: u32,
    /// Limit on waiting for one batch's completions.
    pub completion_timeout: Duration,
    /// The control connection's settings.
    pub tcp: TcpOptions,
}

impl VerbsOptions {
    /// Defaults for `device`: port 1, GID 0, a 64 MiB staging buffer, 64
    /// reads in flight, a 30 s completion limit.
    pub fn new(device: &str) -> VerbsOptions {
        VerbsOptions {
            device: device.to_string(),
            port: 1,
            gid_index: 0,
            staging_bytes: 64 << 20,
            queue_depth: 64,
            completion_timeout: Duration::from_secs(30),
            tcp: TcpOptions::default(),
        }
    }
}

/// The engine's RDMA transport. Fields drop in order: the queue pair before
/// its completion queue and before the staging buffer it reads into.
pub struct VerbsTransport {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    staging: RegisteredBytes,
    control: TcpTransport,
    limits: PlanLimits,
    timeout: Duration,
    /// Set after a failed batch: reads may still be in flight or the queue
    /// pair is in error, so the transport is not used again.
    broken: bool,
}

impl VerbsTransport {
    /// Connect to the peer at `addr`: TCP control connection, then an RC
    /// queue pair on `options.device`, endpoints exchanged over TCP.
    pub fn connect(addr: &str, options: &VerbsOptions) -> Result<VerbsTransport, TransportError> {
        let mut control = TcpTransport::connect(addr, options.tcp)?;
        let ctx = Context::open(&options.device, options.port, options.gid_index)?;
        let pd = ProtectionDomain::new(&ctx)?;
        let depth = options.queue_depth.clamp(1, ctx.max_send_wr());
        let cq = CompletionQueue::new(&ctx, i32::try_from(depth).unwrap_or(i32::MAX))?;
        let mut qp = QueuePair::new(&pd, &cq, depth, QpRole::Reader)?;
        let staging = RegisteredBytes::new(
            &pd,
            vec![0u8; options.staging_bytes.max(1)].into_boxed_slice(),
            access_for(MemoryRole::EngineLanding),
        )?;
        control.begin(0)?;
        control.send(&Request::Connect {
            endpoint: qp.endpoint()?,
        })?;
        let remote = match control.reply()? {
            Response::Connected { endpoint } => endpoint,
            other => {
                return Err(TransportError::Protocol(format!(
                    "{other:?} where an endpoint was expected"
                )));
            }
        };
        qp.connect(&remote)?;
        let max_message = ctx.port_attr()?.max_msg_sz as usize;
        Ok(VerbsTransport {
            limits: PlanLimits {
                max_message,
                staging_bytes: staging.bytes().len(),
                max_outstanding: depth as usize,
            },
            qp,
            cq,
            staging,
            control,
            timeout: options.completion_timeout,
            broken: false,
        })
    }

    fn read_batches(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError> {
        let remote = ops
            .iter()
            .enumerate()
            .map(|(index, op)| match op.location {
                Location::Rdma { addr, rkey } => Ok(RemoteOp {
                    addr,
                    rkey,
                    len: op.len,
                }),
                location => Err(TransportError::Location {
                    index,
                    location,
                    kind: TransportKind::Rdma,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let batches = plan_reads(&remote, self.limits).map_err(VerbsError::from)?;
        let base = self.staging.region().addr();
        let lkey = self.staging.region().lkey();
        for batch in batches {
            let wrs: Vec<ReadWr> = batch
                .reads
                .iter()
                .map(|r| ReadWr {
                    local_addr: base + r.staging_offset as u64,
                    lkey,
                    remote_addr: r.remote_addr,
                    rkey: r.rkey,
                    // A piece is at most the port's max message (a u32).
                    len: u32::try_from(r.len).unwrap_or(u32::MAX),
                })
                .collect();
            self.broken = true;
            // SAFETY: every local range lies in `staging` (the plan keeps
            // pieces inside `staging_bytes`), registered for local write and
            // owned by `self`; no reference to it is used until the batch's
            // completions were all polled below.
            unsafe { self.qp.post_reads(&wrs)? };
            let lens: Vec<usize> = batch.reads.iter().map(|r| r.len).collect();
            self.cq.wait_all(&lens, self.timeout)?;
            self.broken = false;
            let staged = self.staging.bytes();
            for r in &batch.reads {
                let dst = sink_region(sink, r.op, ops[r.op].len)?;
                dst[r.op_offset..r.op_offset + r.len]
                    .copy_from_slice(&staged[r.staging_offset..r.staging_offset + r.len]);
            }
        }
        Ok(())
    }
}

impl Transport for VerbsTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn fetch_manifest(
        &mut self,
        adapter: &str,
        max_rank: u32,
        expert_rank: u32,
        placement: WirePlacement,
    ) -> Result<Manifest, TransportError> {
        self.control
            .manifest_for(adapter, max_rank, expert_rank, placement, TransportKind::Rdma)
    }

    fn read(&mut self, ops: &[ReadOp], sink: &mut dyn LandingSink) -> Result<(), TransportError> {
        if self.broken {
            return Err(TransportError::Protocol(
                "the RDMA queue pair failed earlier; reconnect".into(),
            ));
        }
        self.read_batches(ops, sink)
    }
}

/// The peer's RDMA device: registers stagings for remote read and accepts
/// engine queue pairs.
pub struct PeerDevice {
    pd: Arc<ProtectionDomain>,
}

impl PeerDevice {
    /// Open `device` (port 1, GID 0).
    pub fn open(device: &str) -> Result<PeerDevice, VerbsError> {
        PeerDevice::open_port(device, 1, 0)
    }

    /// Open `device` on `port` with GID `gid_index`.
    pub fn open_port(device: &str, port: u8, gid_index: u8) -> Result<PeerDevice, VerbsError> {
        let ctx = Context::open(device, port, gid_index)?;
        Ok(PeerDevice {
            pd: ProtectionDomain::new(&ctx)?,
        })
    }

    /// Register staged bytes for remote read only.
    pub fn register_remote_read(&self, bytes: Box<[u8]>) -> Result<RegisteredBytes, VerbsError> {
        RegisteredBytes::new(&self.pd, bytes, access_for(MemoryRole::PeerStaging))
    }

    /// A responder queue pair connected to the engine's `remote` endpoint.
    pub fn accept(&self, remote: Endpoint) -> Result<PeerQueuePair, VerbsError> {
        remote.validate()?;
        let cq = CompletionQueue::new(self.pd.context(), 1)?;
        let mut qp = QueuePair::new(&self.pd, &cq, 1, QpRole::Responder)?;
        qp.connect(&remote)?;
        let endpoint = qp.endpoint()?;
        Ok(PeerQueuePair {
            _qp: qp,
            endpoint,
            _cq: cq,
        })
    }
}

/// A peer's queue pair for one engine connection; lives as long as the
/// connection.
pub struct PeerQueuePair {
    /// Held, never driven: the HCA answers the engine's reads through it.
    _qp: QueuePair,
    endpoint: Endpoint,
    _cq: Arc<CompletionQueue>,
}

impl PeerQueuePair {
    /// Its endpoint, for the engine.
    pub fn endpoint(&self) -> Endpoint {
        self.endpoint
    }
}
