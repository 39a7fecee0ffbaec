//! `lora-kernels`: the only crate that touches cudarc (work in progress).
