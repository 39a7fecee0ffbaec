//! `lora-overlay`: per-slot token overlays (work in progress).
