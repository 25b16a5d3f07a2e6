//! Memory helpers for the generated canonical-ABI glue in `bindings.rs`.
//!
//! The host reads and writes guest memory directly: it allocates the strings and lists it
//! returns through our `cabi_realloc` (which the lifting code then owns), reads the
//! arguments we lay out in memory, and writes results into return areas we provide.

use std::alloc::{self, Layout};

/// The `cabi_realloc` export: the host's allocator for values it passes into the guest.
///
/// # Safety
/// Called by the host per the Canonical ABI: `old`/`old_size`/`align` describe a block
/// this function returned before (or are 0 for a fresh allocation).
pub unsafe fn cabi_realloc(old: *mut u8, old_size: usize, align: usize, new_size: usize) -> *mut u8 {
    if old_size != 0 {
        let old_layout = Layout::from_size_align_unchecked(old_size, align);
        if new_size == 0 {
            alloc::dealloc(old, old_layout);
            return align as *mut u8;
        }
        return checked(alloc::realloc(old, old_layout, new_size));
    }
    if new_size == 0 {
        // A zero-sized block: any aligned non-null pointer, never freed.
        return align as *mut u8;
    }
    checked(alloc::alloc(Layout::from_size_align_unchecked(new_size, align)))
}

fn checked(ptr: *mut u8) -> *mut u8 {
    if ptr.is_null() {
        alloc::handle_alloc_error(Layout::new::<u8>());
    }
    ptr
}

/// Allocates a block the host will own or that a post-return frees (zero size: no block).
pub unsafe fn alloc(size: usize, align: usize) -> *mut u8 {
    if size == 0 {
        return align as *mut u8;
    }
    checked(alloc::alloc(Layout::from_size_align_unchecked(size, align)))
}

unsafe fn free(ptr: *mut u8, size: usize, align: usize) {
    if size != 0 {
        alloc::dealloc(ptr, Layout::from_size_align_unchecked(size, align));
    }
}

/// A return area on the stack: the host writes an import's multi-value result here.
#[repr(C, align(8))]
pub struct RetArea<const N: usize>([u8; N]);

impl<const N: usize> RetArea<N> {
    /// An empty return area.
    pub fn new() -> Self {
        RetArea([0; N])
    }
    /// Its address, for the import to write its results to.
    pub fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
}

/// Buffers built to pass arguments in canonical layout (lists of strings, records,
/// handles; spilled parameters), freed when the import call is over.
pub struct Cleanup(Vec<(*mut u8, usize, usize)>);

impl Cleanup {
    /// Nothing to free yet.
    pub fn new() -> Self {
        Cleanup(Vec::new())
    }
    pub unsafe fn alloc(&mut self, size: usize, align: usize) -> *mut u8 {
        let ptr = alloc(size, align);
        self.0.push((ptr, size, align));
        ptr
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for &(ptr, size, align) in &self.0 {
            unsafe { free(ptr, size, align) }
        }
    }
}

/// Takes ownership of a string the host allocated with `cabi_realloc(0, 0, 1, len)`.
pub unsafe fn take_string(ptr: i32, len: i32) -> String {
    match String::from_utf8(take_vec::<u8>(ptr, len)) {
        Ok(s) => s,
        // The Canonical ABI guarantees UTF-8; a host that breaks that is a bug.
        Err(_) => unreachable!("host passed invalid UTF-8"),
    }
}

/// Takes ownership of a list whose elements have the same layout in Rust and in the
/// Canonical ABI (integers and floats).
pub unsafe fn take_vec<T>(ptr: i32, len: i32) -> Vec<T> {
    if len == 0 {
        return Vec::new();
    }
    Vec::from_raw_parts(ptr as *mut T, len as usize, len as usize)
}

/// Lifts each element of a host-allocated list with `lift`, then frees the list's block.
pub unsafe fn take_list<T>(ptr: i32, len: i32, size: usize, align: usize,
                           lift: impl Fn(*const u8) -> T) -> Vec<T> {
    let base = ptr as *mut u8;
    let items = (0..len as usize).map(|i| lift(base.add(i * size))).collect();
    free(base, len as usize * size, align);
    items
}

/// Hands a string to the host until post-return (`take_string` gets it back).
pub fn leak_string(s: String) -> (i32, i32) {
    leak_vec(s.into_bytes())
}

/// Hands a plain list to the host until post-return (`take_vec` gets it back).
pub fn leak_vec<T>(v: Vec<T>) -> (i32, i32) {
    let boxed = v.into_boxed_slice(); // capacity == len, as take_vec assumes
    let len = boxed.len() as i32;
    (Box::into_raw(boxed) as *mut T as i32, len)
}
