use super::*;
use lora_kernels::Device;

/// An image of `elems` BF16 elements read from `dir`.
fn image(dir: &Path, elems: usize) -> HostImage {
    HostImage {
        dir: dir.to_path_buf(),
        stamp: FileStamp(Vec::new()),
        dense: Device::cpu().alloc_pinned(elems).unwrap(),
        dense_pairs: Vec::new(),
        experts: None,
        group_expert_deltas: false,
        overlay: HostOverlay::none(8),
        has_overlay: false,
        dora: None,
    }
}

fn names(tier: &HostTier) -> Vec<String> {
    tier.view().names
}

#[test]
fn the_least_recently_used_image_leaves_first_and_the_bytes_stay_within_budget() {
    let dir = Path::new("/nonexistent");
    let mut tier = HostTier::new(300);
    tier.insert("a", image(dir, 50)).unwrap();
    tier.insert("b", image(dir, 50)).unwrap();
    tier.insert("c", image(dir, 50)).unwrap();
    assert_eq!(tier.view().used, 300);
    assert!(tier.get("a").is_some(), "a used: b is now the oldest");
    tier.insert("d", image(dir, 50)).unwrap();
    assert_eq!(names(&tier), ["c", "a", "d"]);
    assert_eq!(tier.view().used, 300);
    // A larger image (200 bytes) evicts as many as it needs, oldest first.
    tier.insert("e", image(dir, 100)).unwrap();
    assert_eq!(names(&tier), ["d", "e"]);
    assert_eq!(tier.view().used, 300);
}

#[test]
fn pinned_images_are_never_evicted_and_what_cannot_fit_is_refused_unchanged() {
    let dir = Path::new("/nonexistent");
    // Budget 300 bytes; an image of n elements holds 2n bytes.
    let mut tier = HostTier::new(300);
    tier.pin("a", true);
    tier.insert("a", image(dir, 50)).unwrap();
    tier.insert("b", image(dir, 25)).unwrap();
    tier.insert("c", image(dir, 25)).unwrap();
    tier.insert("d", image(dir, 50)).unwrap();
    tier.insert("e", image(dir, 50)).unwrap();
    assert_eq!(
        names(&tier),
        ["a", "d", "e"],
        "b and c, the oldest unpinned, left; a stayed"
    );
    tier.insert("f", image(dir, 100)).unwrap();
    assert_eq!(names(&tier), ["a", "f"]);
    tier.pin("f", true);
    let before = tier.view();
    let err = tier.insert("g", image(dir, 50)).unwrap_err();
    assert_eq!(
        err,
        TierError::Pinned {
            adapter: "g".into(),
            bytes: 100,
            pinned: 300,
            budget: 300
        }
    );
    assert_eq!(tier.view(), before, "a refused insert changes nothing");
    let err = tier.insert("h", image(dir, 151)).unwrap_err();
    assert!(
        matches!(
            err,
            TierError::TooLarge {
                bytes: 302,
                budget: 300,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("302") && err.to_string().contains("300"));
    assert_eq!(tier.view(), before);
    tier.pin("a", false);
    tier.insert("g", image(dir, 50)).unwrap();
    assert_eq!(names(&tier), ["f", "g"], "unpinned, a can leave");
}

#[test]
fn a_new_image_of_a_name_replaces_the_old_one() {
    let dir = Path::new("/nonexistent");
    let mut tier = HostTier::new(300);
    tier.insert("a", image(dir, 100)).unwrap();
    tier.insert("a", image(dir, 50)).unwrap();
    assert_eq!((names(&tier), tier.view().used), (vec!["a".to_string()], 100));
    assert!(tier.remove("a"));
    assert!(!tier.remove("a"));
    assert_eq!(tier.view().used, 0);
}

#[test]
fn an_image_is_current_only_while_its_files_are_unchanged() {
    let dir = std::env::temp_dir().join(format!("lora-host-tier-stamp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(ADAPTER_CONFIG), b"{}").unwrap();
    std::fs::write(dir.join(ADAPTER_WEIGHTS), b"0123").unwrap();
    let mut img = image(&dir, 4);
    img.stamp = FileStamp::of(&dir).unwrap();
    assert!(img.is_current(&dir));
    assert!(!img.is_current(Path::new("/elsewhere")), "another directory");
    std::fs::write(dir.join(ADAPTER_WEIGHTS), b"012345").unwrap();
    assert!(!img.is_current(&dir), "a rewritten weights file");
    std::fs::remove_file(dir.join(ADAPTER_CONFIG)).unwrap();
    assert!(!img.is_current(&dir), "a missing config");
    std::fs::remove_dir_all(&dir).ok();
}
