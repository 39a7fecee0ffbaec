//! `lora-moe`: routed-expert and router LoRA (work in progress).
