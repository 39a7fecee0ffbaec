use super::*;

/// `(key, module path, whether PEFT's re.match(rf"(.*\.)?({key})$", path) hits)`,
/// the booleans as Python 3.11's `re` gives them.
const PYTHON_MATCHES: &[(&str, &str, bool)] = &[
    ("q_proj", "model.layers.0.self_attn.q_proj", true),
    ("q_proj", "model.layers.0.self_attn.kq_proj", false),
    ("self_attn.q_proj", "model.layers.0.self_attn.q_proj", true),
    ("layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj", false),
    ("layers.1.self_attn.q_proj", "model.layers.10.self_attn.q_proj", false),
    ("q_proj|v_proj", "model.layers.0.self_attn.v_proj", true),
    (
        r"layers\.[02]\.self_attn\.(k|v)_proj",
        "model.layers.2.self_attn.v_proj",
        true,
    ),
    ("proj", "model.layers.0.self_attn.q_proj", false),
    (".*proj", "model.layers.0.self_attn.q_proj", true),
    ("experts.down_proj", "model.layers.1.mlp.experts.down_proj", true),
    ("gate", "model.layers.1.mlp.gate.weight", false),
    ("gate.weight", "model.layers.1.mlp.gate.weight", true),
    ("q_proj", "q_proj", true),
    (".q_proj", "model.layers.0.self_attn.q_proj", false),
];

#[test]
fn keys_match_as_python_re_match_does() {
    for &(key, path, want) in PYTHON_MATCHES {
        let re = peft_pattern_regex(key).unwrap();
        assert_eq!(re.is_match(path), want, "key {key:?} on {path:?}");
    }
}

#[test]
fn the_first_matching_key_in_file_order_wins() {
    let table = PatternTable::new(vec![
        ("down_proj".to_string(), 2.0),
        ("model.layers.1.mlp.down_proj".to_string(), 32.0),
    ]);
    assert_eq!(table.lookup("model.layers.1.mlp.down_proj"), Some(("down_proj", 2.0)));
    let reversed = PatternTable::new(vec![
        ("model.layers.1.mlp.down_proj".to_string(), 32.0),
        ("down_proj".to_string(), 2.0),
    ]);
    assert_eq!(
        reversed.lookup("model.layers.1.mlp.down_proj"),
        Some(("model.layers.1.mlp.down_proj", 32.0))
    );
    assert_eq!(reversed.lookup("model.layers.0.mlp.up_proj"), None);
}

#[test]
fn constructs_python_reads_differently_are_refused() {
    for key in [
        r"self_attn\.(?!v)\w+_proj", // look-ahead: no Rust equivalent
        r"(q)_proj\1",               // back-reference
        "[[:alpha:]]_proj",          // POSIX class in Rust, literal `[` in Python
        "[a&&b]_proj",               // set intersection in Rust
        "[a--b]_proj",               // set difference in Rust
        "(?x) q _proj",              // verbose mode
        r"[\b]_proj",                // backspace in Python
        "q_proj\n",                  // control character
        "q_proj{",                   // a literal `{` in Python, an error in Rust
    ] {
        assert!(peft_pattern_regex(key).is_err(), "{key:?} must be refused");
    }
    let table = PatternTable::new(vec![(r"self_attn\.(?!v)\w+".to_string(), 1usize)]);
    assert!(table.entries()[0].error().is_some());
    assert_eq!(table.lookup("model.layers.0.self_attn.q_proj"), None);
}

#[test]
fn ordinary_classes_and_groups_compile() {
    for key in [
        "[]a]_proj",
        "[^]q]_proj",
        r"(?i)Q_PROJ",
        r"(?P<m>q|k)_proj",
        r"[a-z]_proj",
    ] {
        assert!(peft_pattern_regex(key).is_ok(), "{key:?}");
    }
    assert!(
        peft_pattern_regex("(?i)Q_PROJ")
            .unwrap()
            .is_match("model.layers.0.self_attn.q_proj")
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
    #[test]
    fn compiling_any_key_never_panics(key in ".{0,40}") {
        let table = PatternTable::new(vec![(key, 1u8)]);
        let _ = table.lookup("model.layers.0.self_attn.q_proj");
    }
}
