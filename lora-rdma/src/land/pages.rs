//! Huge pages for the landing images, faulted in ahead of the bytes.
//!
//! A landing fills two freshly allocated images. Large allocations come
//! straight from the kernel as untouched pages, so the first write to each
//! 4 KiB page — the socket's copy into the image — traps into the kernel,
//! which zeroes the page and maps it. On the 84 MB benchmark adapter that
//! is 20k faults, and they roughly doubled the time of a loopback copy into
//! fresh memory (measured: 52 ms against 27 ms into a buffer already
//! touched). Asking for transparent huge pages on the image before it is
//! touched turns them into about 40 faults of 2 MiB, and freeing the image
//! gets as cheap ([`advise_huge_pages`]).
//!
//! The kernel still zeroes every page before the socket's copy overwrites
//! it: on a host whose memory is slow that is most of a core for the
//! landing's length. [`populate`] faults the pages in from another thread,
//! ahead of the bytes, so the receiving thread only copies.
//!
//! Neither call changes a byte of the image (untouched pages read as zero
//! either way), and where the kernel lacks either feature (no transparent
//! huge pages, or a kernel before 5.14 for `MADV_POPULATE_WRITE`) they do
//! nothing. Where `defrag` asks for direct compaction on `madvise`d ranges,
//! a fault may compact memory first; the images are short-lived and few, so
//! that is rare.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

/// Images smaller than this are left alone: they may share the heap with
/// other allocations, and have few pages to fault.
pub(crate) const MIN_ADVISED_BYTES: usize = 4 << 20;

/// The most [`populate`] faults in per system call: one huge page, so it
/// stays just ahead of the bytes and stops soon after it is told to.
const POPULATE_STEP: usize = 2 << 20;

/// Ask the kernel to back the whole pages of `bytes` with transparent huge
/// pages. Call it before the bytes are first written. Returns the
/// addresses advised (the whole pages inside `bytes`) when the advice was
/// taken, for [`populate`]; `None` for an image under
/// [`MIN_ADVISED_BYTES`], or where the kernel refuses.
#[cfg(target_os = "linux")]
pub(crate) fn advise_huge_pages(bytes: &[u8]) -> Option<Range<usize>> {
    if bytes.len() < MIN_ADVISED_BYTES {
        return None;
    }
    let range = page_size().and_then(|page| whole_pages(bytes, page))?;
    // SAFETY: the range is the whole pages inside `bytes`, a live allocation
    // this call borrows, so no other memory's advice changes; MADV_HUGEPAGE
    // only sets how the kernel backs pages on their next fault (or when it
    // collapses them later), never their contents, so no byte the program
    // can see changes and no reference is invalidated.
    let rc = unsafe { libc::madvise(range.start as *mut libc::c_void, range.len(), libc::MADV_HUGEPAGE) };
    (rc == 0).then_some(range)
}

/// Elsewhere: no advice.
#[cfg(not(target_os = "linux"))]
pub(crate) fn advise_huge_pages(_bytes: &[u8]) -> Option<Range<usize>> {
    None
}

/// The host's page size.
#[cfg(target_os = "linux")]
pub(crate) fn page_size() -> Option<usize> {
    // SAFETY: sysconf only reads a system constant.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()
}

/// Elsewhere: unknown (nothing is populated).
#[cfg(not(target_os = "linux"))]
pub(crate) fn page_size() -> Option<usize> {
    None
}

/// The pages the landing writes, in landing order, for [`populate`]: each
/// part's address range widened to whole `page`s, kept to the span (of
/// `within`) that holds its start, and joined to the previous one where
/// they touch. An empty part, or one outside every span, adds nothing.
pub(crate) fn landing_spans(
    parts: impl IntoIterator<Item = Range<usize>>,
    within: &[Range<usize>],
    page: usize,
) -> Vec<Range<usize>> {
    let mut spans: Vec<Range<usize>> = Vec::new();
    if !page.is_power_of_two() {
        return spans;
    }
    for part in parts {
        if part.is_empty() {
            continue;
        }
        let Some(outer) = within.iter().find(|w| w.contains(&part.start)) else {
            continue;
        };
        let start = (part.start & !(page - 1)).max(outer.start);
        let end = part
            .end
            .checked_add(page - 1)
            .map_or(usize::MAX, |e| e & !(page - 1))
            .min(outer.end);
        if start >= end {
            continue;
        }
        match spans.last_mut() {
            Some(last) if last.end >= start && last.start <= start => last.end = last.end.max(end),
            _ => spans.push(start..end),
        }
    }
    spans
}

/// Fault in the pages of each span, in order, as a first write would, but
/// without writing (`MADV_POPULATE_WRITE`): the kernel allocates and zeroes
/// them here rather than in the thread that lands the bytes. Stops at the
/// first span the kernel refuses (an older kernel), or once `stop` is set
/// (the read is over). Returns the bytes populated.
///
/// # Safety
///
/// Every span must be page-aligned addresses inside private anonymous
/// memory (a heap allocation) that stays allocated until this returns.
/// Other threads may read and write that memory meanwhile: populating
/// changes no byte of it.
#[cfg(target_os = "linux")]
pub(crate) unsafe fn populate(spans: &[Range<usize>], stop: &AtomicBool) -> usize {
    let mut done = 0;
    for span in spans {
        let mut at = span.start;
        while at < span.end {
            if stop.load(Ordering::Relaxed) {
                return done;
            }
            let len = POPULATE_STEP.min(span.end - at);
            // SAFETY: `at..at + len` lies in `span`, page-aligned private
            // anonymous memory the caller keeps allocated (this function's
            // contract); MADV_POPULATE_WRITE maps a page that is not yet
            // mapped (zeroed, as the first write would) and leaves a mapped
            // one as it is, so no byte another thread can see changes.
            let rc = unsafe { libc::madvise(at as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
            if rc != 0 {
                return done;
            }
            done += len;
            at += len;
        }
    }
    done
}

/// Elsewhere: nothing is populated ahead; the first writes fault.
///
/// # Safety
///
/// None needed; the signature matches the Linux one.
#[cfg(not(target_os = "linux"))]
pub(crate) unsafe fn populate(_spans: &[Range<usize>], _stop: &AtomicBool) -> usize {
    0
}

/// The addresses of the whole `page`-sized pages inside `bytes` (start
/// rounded up, end rounded down), or `None` when there is none or `page` is
/// not a power of two.
pub(crate) fn whole_pages(bytes: &[u8], page: usize) -> Option<Range<usize>> {
    if !page.is_power_of_two() {
        return None;
    }
    let addr = bytes.as_ptr() as usize;
    let start = addr.checked_add(page - 1)? & !(page - 1);
    let end = addr.checked_add(bytes.len())? & !(page - 1);
    (start < end).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pages_stay_inside_the_bytes() {
        let buf = vec![0u8; 5 * 4096];
        for skip in [0usize, 1, 4095, 4096, 4097] {
            for cut in [0usize, 1, 4096, 8191] {
                let bytes = &buf[skip..buf.len() - cut];
                let lo = bytes.as_ptr() as usize;
                let hi = lo + bytes.len();
                match whole_pages(bytes, 4096) {
                    Some(r) => {
                        assert!(lo <= r.start && r.end <= hi, "{skip} {cut}");
                        assert_eq!((r.start % 4096, r.end % 4096), (0, 0));
                        // Every whole page is covered: less than a page is
                        // left out at either end.
                        assert!(r.start - lo < 4096 && hi - r.end < 4096);
                    }
                    None => assert!(hi - lo < 2 * 4096, "{skip} {cut}"),
                }
            }
        }
        assert_eq!(whole_pages(&buf[..100], 4096), None);
        assert_eq!(whole_pages(&buf, 3000), None);
        assert_eq!(whole_pages(&[], 4096), None);
    }

    #[test]
    fn advice_changes_no_byte() {
        let mut big: Vec<u8> = (0..MIN_ADVISED_BYTES + 12_345).map(|i| (i % 251) as u8).collect();
        let before = crate::checksum::xxh64(&big);
        // Whether the kernel takes it depends on the host; the bytes must
        // not change either way, and the memory stays writable.
        if let Some(span) = advise_huge_pages(&big[3..]) {
            let lo = big.as_ptr() as usize;
            assert!(lo + 3 <= span.start && span.end <= lo + big.len());
        }
        assert_eq!(crate::checksum::xxh64(&big), before);
        big.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        assert_eq!(big[1000], (1000 % 251) as u8 + 1);
        // A fresh zeroed allocation advised before its first write reads as
        // zero and takes writes.
        let mut fresh = vec![0u8; MIN_ADVISED_BYTES * 2];
        let _ = advise_huge_pages(&fresh);
        assert!(fresh.iter().all(|&b| b == 0));
        fresh[MIN_ADVISED_BYTES] = 7;
        assert_eq!(fresh.iter().map(|&b| usize::from(b)).sum::<usize>(), 7);
    }

    #[test]
    fn landing_spans_cover_the_parts_in_whole_pages_inside_their_images() {
        let image = 0x10_0000..0x20_0000;
        let other = 0x40_0000..0x48_0000;
        let parts = [
            0x10_0010..0x10_0020, // inside the first page
            0x10_0020..0x10_3001, // touches it: joined, end rounded up
            0x10_5000..0x10_6000, // a gap: a span of its own
            0x1f_f800..0x20_0800, // past the image's end: clipped
            0x30_0000..0x30_1000, // in no image: nothing
            0x40_2001..0x40_2002, // the other image
            0x40_2400..0x40_2800, // inside the last span: joined
            0x40_0000..0x40_0800, // before the last span: its own
        ];
        assert_eq!(
            landing_spans(parts, &[image, other], 0x1000),
            [
                0x10_0000..0x10_4000,
                0x10_5000..0x10_6000,
                0x1f_f000..0x20_0000,
                0x40_2000..0x40_3000,
                0x40_0000..0x40_1000,
            ]
        );
        let page = std::slice::from_ref(&(0..0x1000));
        assert!(landing_spans(std::iter::once(0x10..0x20), page, 3000).is_empty());
        assert!(landing_spans(std::iter::once(0x10..0x10), page, 0x1000).is_empty());
    }

    #[test]
    fn small_images_are_left_alone() {
        let small = vec![0u8; MIN_ADVISED_BYTES - 1];
        assert_eq!(advise_huge_pages(&small), None);
        assert_eq!(advise_huge_pages(&[]), None);
    }

    /// Populating while another thread writes the same memory changes none
    /// of its bytes: written ones keep their values, the rest read zero.
    #[test]
    fn populating_beside_a_writer_changes_no_byte() {
        let mut fresh = vec![0u8; 3 * MIN_ADVISED_BYTES];
        let spans: Vec<Range<usize>> = whole_pages(&fresh, 4096).into_iter().collect();
        let stop = AtomicBool::new(false);
        let populated = std::thread::scope(|s| {
            // SAFETY: `fresh` is a heap allocation that outlives the scope,
            // and the spans are its whole 4 KiB pages (a multiple of the
            // page size on every Linux host).
            let helper = s.spawn(|| unsafe { populate(&spans, &stop) });
            for (i, b) in fresh.iter_mut().enumerate().step_by(1013) {
                *b = (i % 255) as u8 + 1;
            }
            helper.join().unwrap()
        });
        assert!(populated <= spans.iter().map(|r| r.len()).sum());
        for (i, &b) in fresh.iter().enumerate() {
            let want = if i % 1013 == 0 { (i % 255) as u8 + 1 } else { 0 };
            assert_eq!(b, want, "byte {i}");
        }
    }

    #[test]
    fn populating_stops_when_told() {
        let fresh = vec![0u8; 2 * MIN_ADVISED_BYTES];
        let spans: Vec<Range<usize>> = whole_pages(&fresh, 4096).into_iter().collect();
        // SAFETY: as above; `fresh` outlives the call.
        assert_eq!(unsafe { populate(&spans, &AtomicBool::new(true)) }, 0);
        // SAFETY: as above.
        let all = unsafe { populate(&spans, &AtomicBool::new(false)) };
        // All of it, or none on a kernel without MADV_POPULATE_WRITE.
        assert!(all == 0 || all == spans[0].len(), "{all}");
        assert!(fresh.iter().all(|&b| b == 0));
    }
}
