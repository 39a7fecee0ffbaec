//! `lora-pool`: the fixed-address slot pool (work in progress).

pub mod image;
pub mod lease;
pub mod registry;
