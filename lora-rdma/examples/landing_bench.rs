//! Print the TCP landing rate of the 84 MB benchmark adapter against a plain
//! loopback socket copy and a memcpy of the same bytes, from the same run:
//! `cargo run --release -p lora-rdma --example landing_bench [runs]`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let runs = std::env::args().nth(1).and_then(|r| r.parse().ok()).unwrap_or(5);
    match lora_rdma::bench::tcp_landing_rate(runs) {
        Ok(b) => {
            println!(
                "landed {} bytes in {} entries, {} runs: median {:?} ({:.2} GB/s), best {:?}; \
                 plain socket copy median {:?} ({:.2} GB/s): landing at {:.0} % of it; \
                 memcpy median {:?} ({:.2} GB/s); {:?}",
                b.bytes,
                b.entries,
                b.runs,
                b.land_median,
                b.land_gbps(),
                b.land_best,
                b.socket_median,
                b.socket_gbps(),
                100.0 * b.share_of_socket(),
                b.memcpy_median,
                b.memcpy_gbps(),
                b.tuning
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("landing_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
