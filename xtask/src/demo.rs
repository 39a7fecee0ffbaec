//! `cargo xtask demo`: the pipeline on the bundled defaults. For now it
//! plans the pool for each bundled real-size model config.

use lora_layout::{ModelConfig, SlotLayout, full_attention_layers};

/// Real-size model configs bundled with lora-layout's tests.
const BUNDLED: [(&str, &str); 6] = [
    (
        "Llama-3.1-8B",
        include_str!("../../lora-layout/testdata/llama-3.1-8b.json"),
    ),
    ("Qwen3-8B", include_str!("../../lora-layout/testdata/qwen3-8b.json")),
    (
        "Qwen3-30B-A3B",
        include_str!("../../lora-layout/testdata/qwen3-30b-a3b.json"),
    ),
    (
        "Mixtral-8x7B",
        include_str!("../../lora-layout/testdata/mixtral-8x7b.json"),
    ),
    (
        "Qwen3-Next-80B-A3B",
        include_str!("../../lora-layout/testdata/qwen3-next-80b-a3b.json"),
    ),
    (
        "DeepSeek-V3",
        include_str!("../../lora-layout/testdata/deepseek-v3.json"),
    ),
];

/// Run the demo.
pub fn run(_args: &[String]) -> Result<(), String> {
    const MAX_RANK: usize = 16;
    println!("Pool plan at max_rank {MAX_RANK} (BF16, one slot):");
    println!(
        "{:<20} {:>6} {:>9} {:>8} {:>14}",
        "model", "layers", "full-attn", "pairs", "slot bytes"
    );
    for (name, json) in BUNDLED {
        let cfg = ModelConfig::from_hf_config(json).map_err(|e| format!("{name}: {e}"))?;
        let layout = SlotLayout::new(&cfg, MAX_RANK).map_err(|e| format!("{name}: {e}"))?;
        println!(
            "{:<20} {:>6} {:>9} {:>8} {:>14}",
            name,
            cfg.num_hidden_layers,
            full_attention_layers(&cfg).len(),
            layout.entries().len(),
            layout.slot_bytes()
        );
    }
    Ok(())
}
