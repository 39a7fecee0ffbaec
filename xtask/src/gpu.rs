//! `cargo xtask gpu-bundle` and `cargo xtask gpu-test`.

/// Build the GPU test and bench binaries and gather them into `.gpu-bundle/`.
pub fn bundle(_args: &[String]) -> Result<(), String> {
    Err("not built yet".into())
}

/// Build the bundle and run it here (cargo and a GPU on one machine).
pub fn gpu_test(_args: &[String]) -> Result<(), String> {
    Err("not built yet".into())
}
