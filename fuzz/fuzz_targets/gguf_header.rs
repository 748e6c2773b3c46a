//! Fuzzes the GGUF header parser and the tensor slicing built on it: any input must give
//! `Ok` or `Err`, never a panic, an overflow (debug assertions are on under cargo fuzz) or an
//! allocation out of proportion to the input; when it parses, every tensor's data, rows and
//! block-aligned columns must be consistent with each other.

#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use shoal_model::gguf::GgufHeader;

/// Aborts (a crash libFuzzer reports) on any single allocation above `LIMIT`, which is set
/// per input to a bound proportional to its length.
struct Limited;

static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

fn check(size: usize) {
    if size > LIMIT.load(Ordering::Relaxed) {
        std::process::abort();
    }
}

// SAFETY: forwards every call to the system allocator; only checks sizes.
unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Limited = Limited;

fuzz_target!(|data: &[u8]| {
    LIMIT.store((1 << 20) + 16 * data.len(), Ordering::Relaxed);
    let parsed = GgufHeader::parse(data, "fuzz");
    LIMIT.store(usize::MAX, Ordering::Relaxed);
    let Ok(h) = parsed else { return };

    for t in &h.tensors {
        let all = h
            .tensor_data(data, &t.name)
            .expect("a parsed tensor's data is in the file");
        assert_eq!(all.len() as u64, t.size);
        let n_rows = t.n_rows();
        let row_len = t.row_len();
        let bl = t.dtype.block_len();
        if n_rows > 0 {
            let rows = h
                .tensor_rows(data, &t.name, 0..n_rows as usize)
                .expect("all rows");
            assert_eq!(rows, all);
            let rb = t.row_bytes() as usize;
            assert_eq!(rb as u64 * n_rows, t.size);
            let last = n_rows as usize - 1;
            assert_eq!(
                h.tensor_rows(data, &t.name, last..last + 1)
                    .expect("last row"),
                &all[last * rb..]
            );
        }
        assert!(h
            .tensor_rows(data, &t.name, 0..(n_rows as usize).saturating_add(1))
            .is_err());
        let _ = h.tensor_rows(data, &t.name, 0..1);
        if row_len > 0 {
            // Called on tensors with no rows too (an outer dimension of 0).
            let cols = h
                .tensor_cols(data, &t.name, 0..row_len as usize)
                .expect("all columns");
            assert_eq!(cols, all);
            // The last block of every row.
            let end = row_len as usize;
            let last = h
                .tensor_cols(data, &t.name, end - bl..end)
                .expect("last block");
            assert_eq!(last.len() as u64, n_rows * t.dtype.block_bytes() as u64);
        }
        if bl > 1 {
            assert!(h.tensor_cols(data, &t.name, 1..bl).is_err());
        }
        assert!(h
            .tensor_cols(data, &t.name, 0..(row_len as usize).saturating_add(bl))
            .is_err());
    }
});
