// What the decode families share: the rows' entry checks and the 8-aligned
// split of a dimension. Prepended after cluster.cuh and ptx.cuh to bgmv.cu,
// bgmv_entry.cu and bgmv_rows.cu (`cuda_rt::Family::source`).

// Tables of at most this many entries are copied whole into shared memory
// while the row indices arrive, so an item's entry is no second round trip.
#define BGMV_TABLE_SMEM 128

// Piece i of [0, n) split into `parts` pieces whose starts are multiples of 8.
__device__ __forceinline__ void split8(int n, int parts, int i, int& b, int& e) {
    int per = (n + parts - 1) / parts;
    per = (per + 7) & ~7;
    b = min(n, i * per);
    e = min(n, b + per);
}

// A window row's entry index as the scans use it: -1 (no delta) for a
// negative one, or for one past the table, which also raises a fault when `report`.
__device__ __forceinline__ int checked_index(int e, int n_entries, u64 fault, bool report) {
    if (e >= n_entries) {
        if (report) raise_fault(fault, FAULT_BAD_INDEX);
        e = -1;
    }
    return e < 0 ? -1 : e;
}

// A table entry the kernels must not read through: a rank past the stride
// (or the kernels' most), or a missing A or B address. Counted as rank 0.
__device__ __forceinline__ bool bad_entry(const PairEntry& en, int stride) {
    return en.rank > (u32)stride || en.rank > BGMV_MAX_RANK || (en.rank > 0 && (en.a == 0 || en.b == 0));
}

// The entry a row index names, checked: returns the entry index, or -1 (no
// delta) for a negative index or one past the table (which raises
// FAULT_BAD_INDEX when `report`); a bad entry raises FAULT_BAD_RANK when
// `report` and comes back with rank 0. *en is rank 0 whenever -1 is returned.
__device__ __forceinline__ int checked_entry(int raw, int n_entries, const PairEntry* table, int stride, u64 fault,
                                             bool report, PairEntry* en) {
    const int e = checked_index(raw, n_entries, fault, report);
    *en = {0ull, 0ull, 0.f, 0u};
    if (e >= 0) {
        *en = table[e];
        if (bad_entry(*en, stride)) {
            if (report) raise_fault(fault, FAULT_BAD_RANK);
            en->rank = 0;
        }
    }
    return e;
}
