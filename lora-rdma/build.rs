//! Turns the RDMA loopback test on when `LORA_RDMA_DEVICE` names a device at
//! build time (it is `#[ignore]`d otherwise: no RDMA device exists on the
//! machines this is usually built on).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(lora_rdma_device)");
    println!("cargo::rerun-if-env-changed=LORA_RDMA_DEVICE");
    if std::env::var("LORA_RDMA_DEVICE").is_ok_and(|d| !d.trim().is_empty()) {
        println!("cargo::rustc-cfg=lora_rdma_device");
    }
}
