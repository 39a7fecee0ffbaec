//! Checked-in tables of launch decisions (tests only): the planner's choice
//! for a grid of calls on the recorded devices, compared line by line with
//! a file next to the code. `LORA_UPDATE_GOLDEN=1` rewrites the file (then
//! review the diff: every changed line is a changed launch).

use std::path::Path;

/// Compare `actual` with the file at `path` (relative to the crate root).
pub(crate) fn check(path: &str, actual: &str) {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    if std::env::var_os("LORA_UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(&full, actual).unwrap_or_else(|e| panic!("cannot write {}: {e}", full.display()));
        return;
    }
    let expected = std::fs::read_to_string(&full)
        .unwrap_or_else(|e| panic!("cannot read {} ({e}); LORA_UPDATE_GOLDEN=1 writes it", full.display()));
    if expected == actual {
        return;
    }
    let mut report = String::new();
    let (mut e, mut a) = (expected.lines(), actual.lines());
    let mut shown = 0;
    for line in 1.. {
        match (e.next(), a.next()) {
            (None, None) => break,
            (want, got) if want != got => {
                report += &format!("line {line}:\n  expected {want:?}\n  actual   {got:?}\n");
                shown += 1;
                if shown == 20 {
                    report += "  ...\n";
                    break;
                }
            }
            _ => {}
        }
    }
    panic!("{path} differs from the planner's decisions (LORA_UPDATE_GOLDEN=1 rewrites it):\n{report}");
}
