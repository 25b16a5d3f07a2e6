//! The SDK's global allocator: the system allocator, plus one log line when an allocation
//! fails. Rust aborts on a failed allocation without a message on wasm32-unknown-unknown
//! (the `unreachable` trap), so without this line the host could only guess that
//! runtime.memory_limit_mb was hit; with it the end reason says so (`trap: out of memory:
//! an allocation of N bytes failed ...`). The line is formatted on the stack: nothing here
//! may allocate. An inferlet that declares its own `#[global_allocator]` cannot link the
//! SDK's (a compile error names both).

use std::alloc::{GlobalAlloc, Layout, System};
use std::fmt::Write;

use crate::bindings::runtime;

/// The allocator `inferlet` installs as the global one.
pub struct ReportingAllocator;

#[global_allocator]
static ALLOCATOR: ReportingAllocator = ReportingAllocator;

unsafe impl GlobalAlloc for ReportingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        checked(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        checked(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        checked(unsafe { System.realloc(ptr, layout, new_size) }, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        let mut line = StackLine { buf: [0; 96], len: 0 };
        let _ = write!(line, "out of memory: an allocation of {size} bytes failed");
        runtime::log(runtime::LogLevel::Error, line.as_str());
    }
    ptr
}

/// A line formatted into a fixed buffer (cut if it does not fit).
struct StackLine {
    buf: [u8; 96],
    len: usize,
}

impl StackLine {
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("out of memory")
    }
}

impl Write for StackLine {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}
