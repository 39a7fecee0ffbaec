//! `cargo xtask fixtures`: regenerate `fixtures/` with real PEFT.

/// Run the fixture generator.
pub fn run(_args: &[String]) -> Result<(), String> {
    Err("not built yet".into())
}
