//! `lora-rdma`: land peer-staged adapters into a pool slot (work in progress).
