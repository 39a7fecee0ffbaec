use super::*;

#[test]
fn row_views_are_checked_against_their_buffer() {
    let d = Device::cpu();
    let buf = d.alloc_zeros::<bf16>(100).unwrap();
    assert!(Rows::dense(&buf, 10, 10).check(&d, "x").is_ok());
    assert!(Rows::dense(&buf, 11, 10).check(&d, "x").is_err());
    // Strided: 3 rows of 10, 40 apart, from 10: the last element is 10 + 80 + 9 = 99.
    assert!(
        Rows {
            buf: &buf,
            offset: 10,
            n_rows: 3,
            width: 10,
            stride: 40
        }
        .check(&d, "x")
        .is_ok()
    );
    assert!(
        Rows {
            buf: &buf,
            offset: 11,
            n_rows: 3,
            width: 10,
            stride: 40
        }
        .check(&d, "x")
        .is_err()
    );
    // A stride below the width overlaps rows.
    assert!(
        Rows {
            buf: &buf,
            offset: 0,
            n_rows: 2,
            width: 10,
            stride: 5
        }
        .check(&d, "x")
        .is_err()
    );
    assert!(Rows::dense(&buf, 0, 10).check(&d, "x").is_ok());
    assert!(Rows::dense(&buf, 1, 10).check(&Device::cpu(), "x").is_err());
}

#[test]
fn targets_are_checked() {
    let d = Device::cpu();
    let table = d.alloc_zeros::<PairEntry>(8).unwrap();
    let t = |offset, n_entries, out_dim, col| LoraTarget {
        table: &table,
        table_offset: offset,
        n_entries,
        out_dim,
        y_col_offset: col,
        dora: None,
    };
    assert!(check_targets(&d, &[t(0, 4, 8, 0), t(4, 4, 8, 8)], 16).is_ok());
    assert!(check_targets(&d, &[], 16).is_err());
    assert!(check_targets(&d, &[t(0, 1, 1, 0); 5], 16).is_err());
    assert!(
        check_targets(&d, &[t(5, 4, 8, 0)], 16).is_err(),
        "table range past the buffer"
    );
    assert!(check_targets(&d, &[t(0, 4, 8, 9)], 16).is_err(), "columns past y");
    assert!(
        check_targets(&d, &[t(0, 4, 8, 0), t(4, 4, 8, 7)], 16).is_err(),
        "overlapping columns"
    );
    let p = check_targets(&d, &[t(2, 4, 8, 3)], 16).unwrap();
    assert_eq!(p[0].table, table.device_addr() + 2 * 24);
    assert_eq!((p[0].n_entries, p[0].out_dim, p[0].y_col_off), (4, 8, 3));
}

/// The shared constants are defined once, by the host: every translation
/// unit starts with them, and no CUDA source defines one itself.
#[test]
fn shared_constants_are_defined_once_by_the_host() {
    let defines = cuda_defines();
    let mut names: Vec<&str> = defines.iter().map(|(n, _)| *n).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), defines.len(), "a name defined twice");
    for (file, source) in crate::kernel_sources() {
        assert!(source.starts_with(&crate::cuda_rt::prelude()), "{file}");
        let body = &source[crate::cuda_rt::prelude().len()..];
        for (name, _) in &defines {
            let defined = body.lines().any(|l| {
                l.trim_start()
                    .strip_prefix("#define")
                    .is_some_and(|r| r.split_whitespace().next() == Some(*name))
            });
            assert!(!defined, "{file} defines {name}, which the host's prelude defines");
        }
    }
    assert!(defines.contains(&("MAX_TARGETS", MAX_TARGETS)));
}
