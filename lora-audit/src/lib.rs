//! `lora-audit`: the gate between untrusted PEFT adapter files and the GPU (work in progress).
