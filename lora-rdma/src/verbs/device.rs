//! RAII wrappers over the `ibverbs-sys` objects the transport uses: device
//! context, protection domain, memory regions, completion queue and RC
//! queue pair. Each owns its handle and whatever it depends on (an `Arc`
//! of its parent), so a parent always outlives its children; each `Drop`
//! releases the handle and ignores the status (it cannot be acted on, and
//! a `Drop` must not panic).

use std::ffi::CStr;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::protocol::Endpoint;
use crate::verbs::{Access, VerbsError, WcStatus};

/// The `ibv_access_flags` of `access`.
pub(crate) fn access_flags(access: Access) -> ffi::ibv_access_flags {
    let mut flags = ffi::ibv_access_flags(0);
    for (on, flag) in [
        (access.local_write, ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE),
        (access.remote_read, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ),
        (access.remote_write, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE),
        (access.remote_atomic, ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC),
    ] {
        if on {
            flags |= flag;
        }
    }
    flags
}

/// The RDMA devices of this host, by name.
pub fn list_devices() -> Result<Vec<String>, VerbsError> {
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { ffi::ibv_get_device_list(&mut n) };
    let Some(list) = NonNull::new(list) else {
        return Err(VerbsError::call("ibv_get_device_list", 0));
    };
    let names = (0..usize::try_from(n).unwrap_or(0))
        .filter_map(|i| {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.as_ptr().add(i) };
            device_name(dev)
        })
        .collect();
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ffi::ibv_free_device_list(list.as_ptr()) };
    Ok(names)
}

fn device_name(dev: *mut ffi::ibv_device) -> Option<String> {
    if dev.is_null() {
        return None;
    }
    // SAFETY: `dev` is a live entry of a device list.
    let name = unsafe { ffi::ibv_get_device_name(dev) };
    // SAFETY: a non-null name is a NUL-terminated string owned by the list.
    (!name.is_null()).then(|| unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
}

/// An open device, with the port and GID it uses.
pub struct Context {
    ctx: NonNull<ffi::ibv_context>,
    port: u8,
    gid_index: u8,
    /// RDMA READs this device may have outstanding as initiator (`max_qp_init_rd_atom`).
    max_init_rd_atom: u8,
    /// RDMA READs this device accepts outstanding as responder (`max_qp_rd_atom`).
    max_rd_atom: u8,
    max_send_wr: u32,
    max_cqe: i32,
}

// SAFETY: libibverbs contexts may be used from any thread; every call here
// that mutates provider state is internally synchronised by libibverbs.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Open the device named `name` and use `port` with GID `gid_index`.
    pub fn open(name: &str, port: u8, gid_index: u8) -> Result<Arc<Context>, VerbsError> {
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        let Some(list) = NonNull::new(list) else {
            return Err(VerbsError::call("ibv_get_device_list", 0));
        };
        let found = (0..usize::try_from(n).unwrap_or(0))
            // SAFETY: the list holds `n` device pointers.
            .map(|i| unsafe { *list.as_ptr().add(i) })
            .find(|&dev| device_name(dev).as_deref() == Some(name));
        // SAFETY: a device found in the list is valid until the list is freed;
        // opening it first keeps the context valid after.
        let ctx = found.map(|dev| unsafe { ffi::ibv_open_device(dev) });
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ffi::ibv_free_device_list(list.as_ptr()) };
        let ctx = match ctx {
            None => return Err(VerbsError::NoDevice(name.to_string())),
            Some(ctx) => NonNull::new(ctx).ok_or_else(|| VerbsError::call("ibv_open_device", 0))?,
        };
        let mut context = Context {
            ctx,
            port,
            gid_index,
            max_init_rd_atom: 1,
            max_rd_atom: 1,
            max_send_wr: 1,
            max_cqe: 1,
        };
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: `ctx` is open; `attr` is a valid out-struct.
        let rc = unsafe { ffi::ibv_query_device(context.ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_device", rc));
        }
        context.max_init_rd_atom = u8::try_from(attr.max_qp_init_rd_atom.clamp(1, 16)).unwrap_or(1);
        context.max_rd_atom = u8::try_from(attr.max_qp_rd_atom.clamp(1, 16)).unwrap_or(1);
        context.max_send_wr = u32::try_from(attr.max_qp_wr.max(1)).unwrap_or(1);
        context.max_cqe = attr.max_cqe.max(1);
        let port_attr = context.port_attr()?;
        if port_attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(VerbsError::Port {
                port,
                reason: format!("not active (state {})", port_attr.state),
            });
        }
        Ok(Arc::new(context))
    }

    pub(crate) fn port(&self) -> u8 {
        self.port
    }

    /// Outstanding RDMA READs a queue pair of `role` allows (at most 16).
    pub(crate) fn rd_atomic(&self, role: QpRole) -> u8 {
        match role {
            QpRole::Reader => self.max_init_rd_atom,
            QpRole::Responder => self.max_rd_atom,
        }
    }

    /// The deepest send queue the device allows.
    pub(crate) fn max_send_wr(&self) -> u32 {
        self.max_send_wr
    }

    /// The largest completion queue the device allows.
    pub(crate) fn max_cqe(&self) -> i32 {
        self.max_cqe
    }

    pub(crate) fn port_attr(&self) -> Result<ffi::ibv_port_attr, VerbsError> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the exported `ibv_query_port` fills the leading (compat)
        // part of `ibv_port_attr`, which is a prefix of the full struct.
        let rc = unsafe {
            ffi::ibv_query_port(
                self.ctx.as_ptr(),
                self.port,
                (&mut attr as *mut ffi::ibv_port_attr).cast::<ffi::_compat_ibv_port_attr>(),
            )
        };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_port", rc));
        }
        Ok(attr)
    }

    pub(crate) fn gid(&self) -> Result<[u8; 16], VerbsError> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: `ctx` is open; `gid` is a valid out-union.
        let rc = unsafe { ffi::ibv_query_gid(self.ctx.as_ptr(), self.port, i32::from(self.gid_index), &mut gid) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_query_gid", rc));
        }
        // SAFETY: every bit pattern of the union is a valid `raw`.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device, closed once; children hold an
        // `Arc<Context>` and are gone by now.
        let _ = unsafe { ffi::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// A protection domain.
pub(crate) struct ProtectionDomain {
    pd: NonNull<ffi::ibv_pd>,
    ctx: Arc<Context>,
}

// SAFETY: protection domains are usable from any thread (libibverbs).
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Arc<ProtectionDomain>, VerbsError> {
        // SAFETY: the context is open.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsError::call("ibv_alloc_pd", 0))?;
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: Arc::clone(ctx),
        }))
    }

    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd, freed once after every region
        // and queue pair (which hold an Arc of it).
        let _ = unsafe { ffi::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// A registered memory region. It does not own the memory: the owner
/// ([`RegisteredBytes`], the landing buffer) keeps the memory alive longer.
pub struct MemoryRegion {
    mr: NonNull<ffi::ibv_mr>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: a memory region handle is plain data to libibverbs.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Register `len` bytes at `addr` with exactly `access`.
    ///
    /// # Safety
    /// The memory must stay allocated, and not be moved, until the region
    /// is dropped; while the HCA may write it, no Rust reference to it may
    /// be in use.
    pub(crate) unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<MemoryRegion, VerbsError> {
        let flags = access_flags(access).0 as i32;
        // SAFETY: the caller guarantees the memory outlives the region.
        let mr = unsafe { ffi::ibv_reg_mr(pd.pd.as_ptr(), addr.cast(), len, flags) };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::call("ibv_reg_mr", 0))?;
        Ok(MemoryRegion {
            mr,
            _pd: Arc::clone(pd),
        })
    }

    /// The registered start address (the remote address of offset 0).
    pub fn addr(&self) -> u64 {
        // SAFETY: the region is registered until drop.
        unsafe { (*self.mr.as_ptr()).addr as u64 }
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// The local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr.as_ptr()).lkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr, deregistered once, before the
        // owner frees the memory (its field order guarantees it).
        let _ = unsafe { ffi::ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// Heap bytes with a registration for one role. The memory is held as a
/// raw allocation, not a `Box`, because the HCA may write it behind Rust's
/// back (the engine's landing buffer); slices of it are made only when no
/// RDMA operation can be writing it. The registration is released before
/// the memory is freed.
pub struct RegisteredBytes {
    region: ManuallyDrop<MemoryRegion>,
    ptr: NonNull<u8>,
    len: usize,
}

/// Free an allocation made by `Box::leak` of a `Box<[u8]>`.
///
/// # Safety
/// `ptr`/`len` must come from such a leak, freed once, with no HCA access
/// left to it.
unsafe fn free_leaked(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller's contract.
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) });
}

// SAFETY: the value owns its allocation exclusively, like a `Box<[u8]>`;
// the HCA reads (peer) or writes (engine, only while the owning transport
// holds `&mut`) it under this crate's control.
unsafe impl Send for RegisteredBytes {}
// SAFETY: shared access only reads the bytes (see `bytes`).
unsafe impl Sync for RegisteredBytes {}

impl RegisteredBytes {
    /// Take `bytes` over and register them with `access`.
    pub(crate) fn new(pd: &Arc<ProtectionDomain>, bytes: Box<[u8]>, access: Access) -> Result<Self, VerbsError> {
        let len = bytes.len();
        let ptr = NonNull::from(Box::leak(bytes)).cast::<u8>();
        // SAFETY: the allocation is owned by the returned value and freed
        // only in its `Drop`, after the region is deregistered.
        match unsafe { MemoryRegion::register(pd, ptr.as_ptr(), len, access) } {
            Ok(region) => Ok(RegisteredBytes {
                region: ManuallyDrop::new(region),
                ptr,
                len,
            }),
            Err(e) => {
                // SAFETY: just leaked above, never registered.
                unsafe { free_leaked(ptr, len) };
                Err(e)
            }
        }
    }

    /// The bytes. The peer's regions are only ever read by the HCA; the
    /// engine's landing buffer is read only after every RDMA READ into it
    /// completed (its transport holds `&mut` while reads are in flight).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` owns `len` initialised bytes until drop; see above
        // for why nothing writes them while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The registration.
    pub fn region(&self) -> &MemoryRegion {
        &self.region
    }
}

impl Drop for RegisteredBytes {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and never used after.
        unsafe { ManuallyDrop::drop(&mut self.region) };
        // SAFETY: leaked in `new`, freed once, after deregistration.
        unsafe { free_leaked(self.ptr, self.len) };
    }
}

/// A completion queue.
pub(crate) struct CompletionQueue {
    cq: NonNull<ffi::ibv_cq>,
    ctx: Arc<Context>,
}

// SAFETY: completion queues may be polled from any thread; this crate polls
// each from one thread at a time (`&mut` on the owning transport).
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    pub(crate) fn new(ctx: &Arc<Context>, entries: i32) -> Result<Arc<CompletionQueue>, VerbsError> {
        let entries = entries.clamp(1, ctx.max_cqe());
        // SAFETY: the context is open; no channel, no user context.
        let cq =
            unsafe { ffi::ibv_create_cq(ctx.ctx.as_ptr(), entries, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        let cq = NonNull::new(cq).ok_or_else(|| VerbsError::call("ibv_create_cq", 0))?;
        Ok(Arc::new(CompletionQueue {
            cq,
            ctx: Arc::clone(ctx),
        }))
    }

    /// Poll until `expected` completions arrived, checking each; `lens[wr_id]`
    /// is the byte count each must report.
    pub(crate) fn wait_all(&self, lens: &[usize], timeout: Duration) -> Result<(), VerbsError> {
        // SAFETY: the context's ops table is filled by the provider at open.
        let poll = unsafe { (*self.ctx.ctx.as_ptr()).ops.poll_cq };
        let Some(poll) = poll else {
            return Err(VerbsError::call("poll_cq", libc_enosys()));
        };
        let deadline = Instant::now() + timeout;
        let mut done = 0usize;
        let mut wcs = [ffi::ibv_wc::default(); 32];
        let mut first_error = None;
        while done < lens.len() {
            // SAFETY: `wcs` has room for its length in entries.
            let n = unsafe { poll(self.cq.as_ptr(), wcs.len() as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(VerbsError::call("ibv_poll_cq", -n));
            }
            for wc in &wcs[..n as usize] {
                done += 1;
                if first_error.is_some() {
                    continue;
                }
                if let Some((status, vendor_err)) = wc.error() {
                    first_error = VerbsError::completion(wc.wr_id(), WcStatus::from_code(status), vendor_err);
                    continue;
                }
                let expected = usize::try_from(wc.wr_id()).ok().and_then(|i| lens.get(i)).copied();
                if expected != Some(wc.len()) {
                    first_error = Some(VerbsError::ShortRead {
                        wr_id: wc.wr_id(),
                        got: wc.len(),
                        expected: expected.unwrap_or(0),
                    });
                }
            }
            if n == 0 {
                if Instant::now() >= deadline {
                    return Err(VerbsError::Timeout(timeout));
                }
                std::thread::yield_now();
            }
        }
        // Completed reads' data is visible to the CPU only after their
        // completions were seen.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        first_error.map_or(Ok(()), Err)
    }
}

fn libc_enosys() -> i32 {
    38
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq, destroyed once after its queue
        // pairs (which hold an Arc of it).
        let _ = unsafe { ffi::ibv_destroy_cq(self.cq.as_ptr()) };
    }
}

/// Which end of the connection a queue pair is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QpRole {
    /// The engine: issues RDMA READs, grants no remote access.
    Reader,
    /// The peer: answers RDMA READs against its remote-read regions.
    Responder,
}

/// An RC queue pair.
pub(crate) struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    psn: u32,
    role: QpRole,
    _cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: queue pairs may be used from any thread; each is driven by one
// thread at a time here (`&mut` on its owner).
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

fn modify(
    qp: NonNull<ffi::ibv_qp>,
    attr: &mut ffi::ibv_qp_attr,
    mask: ffi::ibv_qp_attr_mask,
) -> Result<(), VerbsError> {
    // SAFETY: `qp` is live; `attr` is fully initialised for `mask`.
    let rc = unsafe { ffi::ibv_modify_qp(qp.as_ptr(), attr, mask.0 as i32) };
    if rc != 0 {
        return Err(VerbsError::call("ibv_modify_qp", rc));
    }
    Ok(())
}

/// A fresh 24-bit packet sequence number (distinct per call in a process,
/// and across processes started at different times).
fn initial_psn() -> u32 {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let seed = [nanos, u64::from(std::process::id()), call];
    let bytes: Vec<u8> = seed.iter().flat_map(|v| v.to_le_bytes()).collect();
    (crate::checksum::xxh64(&bytes) & 0xff_ffff) as u32
}

/// One RDMA READ work request: `len` bytes from `remote_addr` (`rkey`) into
/// local `local_addr` (`lkey`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadWr {
    pub(crate) local_addr: u64,
    pub(crate) lkey: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) len: u32,
}

impl QueuePair {
    /// Create an RC queue pair with `depth` send slots and move it to INIT
    /// with the access its role needs.
    pub(crate) fn new(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        depth: u32,
        role: QpRole,
    ) -> Result<QueuePair, VerbsError> {
        let ctx = pd.context();
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq.cq.as_ptr(),
            recv_cq: cq.cq.as_ptr(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: depth.clamp(1, ctx.max_send_wr()),
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: the PD and CQ are live; `init` is fully initialised.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| VerbsError::call("ibv_create_qp", 0))?;
        let queue_pair = QueuePair {
            qp,
            psn: initial_psn(),
            role,
            _cq: Arc::clone(cq),
            pd: Arc::clone(pd),
        };
        let remote = match role {
            QpRole::Reader => Access::default(),
            QpRole::Responder => Access {
                remote_read: true,
                ..Access::default()
            },
        };
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: ctx.port(),
            qp_access_flags: access_flags(remote).0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        modify(
            qp,
            &mut attr,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
        )?;
        Ok(queue_pair)
    }

    /// This queue pair's endpoint, for the other side.
    pub(crate) fn endpoint(&self) -> Result<Endpoint, VerbsError> {
        let ctx = self.pd.context();
        let port = ctx.port_attr()?;
        Ok(Endpoint {
            lid: port.lid,
            // SAFETY: the queue pair is live.
            qpn: unsafe { (*self.qp.as_ptr()).qp_num },
            psn: self.psn,
            gid: ctx.gid()?,
            mtu: u8::try_from(port.active_mtu).unwrap_or(1),
            rd_atomic: ctx.rd_atomic(self.role),
        })
    }

    /// Connect to `remote`: INIT → RTR → RTS. A reader keeps at most as
    /// many RDMA READs in flight as the responder advertised.
    pub(crate) fn connect(&mut self, remote: &Endpoint) -> Result<(), VerbsError> {
        remote.validate()?;
        let ctx = Arc::clone(self.pd.context());
        let local = self.endpoint()?;
        let role = self.role;
        let global = remote.gid != [0; 16];
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: u32::from(local.mtu.min(remote.mtu)),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: match role {
                QpRole::Responder => local.rd_atomic,
                QpRole::Reader => 1,
            },
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid },
                    flow_label: 0,
                    sgid_index: ctx.gid_index,
                    hop_limit: 64,
                    traffic_class: 0,
                },
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: u8::from(global),
                port_num: ctx.port(),
            },
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        modify(
            self.qp,
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: match role {
                QpRole::Reader => local.rd_atomic.min(remote.rd_atomic),
                QpRole::Responder => 1,
            },
            ..Default::default()
        };
        modify(
            self.qp,
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Post one signalled RDMA READ per request, chained in one call; work
    /// request ids are the indices.
    ///
    /// # Safety
    /// Every local range must lie in memory registered with `lkey` for
    /// local write that stays alive, and unread by Rust, until the reads
    /// complete.
    pub(crate) unsafe fn post_reads(&mut self, reads: &[ReadWr]) -> Result<(), VerbsError> {
        if reads.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<ffi::ibv_sge> = reads
            .iter()
            .map(|r| ffi::ibv_sge {
                addr: r.local_addr,
                length: r.len,
                lkey: r.lkey,
            })
            .collect();
        let mut wrs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(reads.len());
        for (i, r) in reads.iter().enumerate() {
            let mut wr = ffi::ibv_send_wr {
                wr_id: i as u64,
                next: std::ptr::null_mut(),
                // SAFETY: `sges` is not resized while `wrs` is in use.
                sg_list: unsafe { sges.as_mut_ptr().add(i) },
                num_sge: 1,
                opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
                send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
                ..Default::default()
            };
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: r.remote_addr,
                rkey: r.rkey,
            };
            wrs.push(wr);
        }
        let base = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            // SAFETY: both indices are in bounds of `wrs`, which is not resized.
            unsafe { (*base.add(i - 1)).next = base.add(i) };
        }
        let ctx = self.pd.context();
        // SAFETY: the context's ops table is filled by the provider at open.
        let Some(post) = (unsafe { (*ctx.ctx.as_ptr()).ops.post_send }) else {
            return Err(VerbsError::call("post_send", libc_enosys()));
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the chain and its SGEs live until the call returns (the
        // provider copies them into the send queue); the caller guarantees
        // the local memory.
        let rc = unsafe { post(self.qp.as_ptr(), base, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::call("ibv_post_send", rc));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp, destroyed once; it holds Arcs of
        // its CQ and PD, which are therefore destroyed after it.
        let _ = unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{MemoryRole, access_for};

    #[test]
    fn registrations_carry_exactly_the_flags_of_their_role() {
        assert_eq!(
            access_flags(access_for(MemoryRole::PeerStaging)),
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
        );
        assert_eq!(
            access_flags(access_for(MemoryRole::EngineLanding)),
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        );
        let all = Access {
            local_write: true,
            remote_read: true,
            remote_write: true,
            remote_atomic: true,
        };
        let f = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC;
        assert_eq!(access_flags(all), f);
    }

    #[test]
    fn a_missing_device_is_an_error_not_a_panic() {
        let err = Context::open("lora-rdma-no-such-device", 1, 0).err().unwrap();
        assert!(
            matches!(err, VerbsError::NoDevice(_) | VerbsError::Call { .. }),
            "{err}"
        );
    }

    #[test]
    fn psns_are_24_bits_and_vary() {
        let psns: std::collections::HashSet<u32> = (0..64).map(|_| initial_psn()).collect();
        assert!(psns.iter().all(|&p| p < 1 << 24));
        assert!(psns.len() > 60);
    }
}
