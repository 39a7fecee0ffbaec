//! Print the TCP landing rate of the 84 MB benchmark adapter against memcpy:
//! `cargo run --release -p lora-rdma --example landing_bench [runs]`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let runs = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(5);
    match lora_rdma::bench::tcp_landing_rate(runs) {
        Ok(b) => {
            println!(
                "landed {} bytes in {} entries, {} runs: median {:?} ({:.2} GB/s), best {:?}; memcpy median {:?} ({:.2} GB/s)",
                b.bytes,
                b.entries,
                b.runs,
                b.land_median,
                b.land_gbps(),
                b.land_best,
                b.memcpy_median,
                b.memcpy_gbps()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("landing_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
