//! The `malloc` family, counted: what [`install_allocation_counters!`](crate::install_allocation_counters)
//! exports from an executable. glibc lets a program replace these
//! functions; every library the process loads later (a notebook cell's
//! shared library included) then allocates through them, so the counters
//! see every byte, when it is allocated, not when someone samples.
//!
//! Sizes are what the allocator really reserved for each block
//! (`malloc_usable_size`), so a block counts the same when it is freed as
//! when it was allocated.

use std::ffi::{c_int, c_void};

use super::counters::active;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(count: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_free(ptr: *mut c_void);
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    fn __libc_valloc(size: usize) -> *mut c_void;
    fn __libc_pvalloc(size: usize) -> *mut c_void;
    fn malloc_usable_size(ptr: *mut c_void) -> usize;
}

#[inline]
unsafe fn counted(ptr: *mut c_void) -> *mut c_void {
    if !ptr.is_null() {
        active().allocated(malloc_usable_size(ptr) as u64);
    }
    ptr
}

/// # Safety
/// The C `malloc` contract.
pub unsafe fn malloc(size: usize) -> *mut c_void {
    counted(__libc_malloc(size))
}

/// # Safety
/// The C `calloc` contract.
pub unsafe fn calloc(count: usize, size: usize) -> *mut c_void {
    counted(__libc_calloc(count, size))
}

/// # Safety
/// The C `realloc` contract.
pub unsafe fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    if ptr.is_null() {
        return malloc(size);
    }
    let old = malloc_usable_size(ptr) as u64;
    let new = __libc_realloc(ptr, size);
    if !new.is_null() {
        active().freed(old);
        counted(new);
    } else if size == 0 {
        // glibc frees the block and returns null.
        active().freed(old);
    }
    new
}

/// # Safety
/// The C `reallocarray` contract.
pub unsafe fn reallocarray(ptr: *mut c_void, count: usize, size: usize) -> *mut c_void {
    match count.checked_mul(size) {
        Some(bytes) => realloc(ptr, bytes),
        None => {
            *libc::__errno_location() = libc::ENOMEM;
            std::ptr::null_mut()
        }
    }
}

/// # Safety
/// The C `free` contract.
pub unsafe fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    active().freed(malloc_usable_size(ptr) as u64);
    __libc_free(ptr);
}

/// # Safety
/// The C `memalign` contract.
pub unsafe fn memalign(align: usize, size: usize) -> *mut c_void {
    counted(__libc_memalign(align, size))
}

/// # Safety
/// The C `aligned_alloc` contract.
pub unsafe fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    if !align.is_power_of_two() {
        *libc::__errno_location() = libc::EINVAL;
        return std::ptr::null_mut();
    }
    memalign(align, size)
}

/// # Safety
/// The C `posix_memalign` contract.
pub unsafe fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let ptr = memalign(align, size);
    if ptr.is_null() {
        return libc::ENOMEM;
    }
    *out = ptr;
    0
}

/// # Safety
/// The C `valloc` contract.
pub unsafe fn valloc(size: usize) -> *mut c_void {
    counted(__libc_valloc(size))
}

/// # Safety
/// The C `pvalloc` contract.
pub unsafe fn pvalloc(size: usize) -> *mut c_void {
    counted(__libc_pvalloc(size))
}

/// Makes this executable count every heap allocation of its process, for
/// [`HostMemory`](crate::memory::HostMemory), `%mem` and the simulated
/// device budget. Invoke once, at the top level of a binary crate (never in
/// a library: a cell library that defined `malloc` would replace it for the
/// whole process), and call [`install`](crate::memory::install) first thing
/// in `main`.
///
/// The binary must also export the `vramlab_alloc_counters` symbol so that
/// code in shared libraries finds the counters: link with
/// `-Wl,--export-dynamic-symbol=vramlab_alloc_counters` (a `build.rs` line
/// `cargo:rustc-link-arg-bins=...`).
///
/// On targets other than Linux with glibc it expands to nothing and the
/// probes fall back to sampling.
#[macro_export]
macro_rules! install_allocation_counters {
    () => {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        mod vramlab_allocation_counters {
            use ::std::ffi::{c_int, c_void};
            use $crate::memory::interpose as counted;

            #[no_mangle]
            pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
                counted::malloc(size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn calloc(count: usize, size: usize) -> *mut c_void {
                counted::calloc(count, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
                counted::realloc(ptr, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn reallocarray(ptr: *mut c_void, count: usize, size: usize) -> *mut c_void {
                counted::reallocarray(ptr, count, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn free(ptr: *mut c_void) {
                counted::free(ptr)
            }
            #[no_mangle]
            pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
                counted::memalign(align, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
                counted::aligned_alloc(align, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
                counted::posix_memalign(out, align, size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
                counted::valloc(size)
            }
            #[no_mangle]
            pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
                counted::pvalloc(size)
            }
            #[no_mangle]
            pub extern "C" fn vramlab_alloc_counters() -> *const c_void {
                $crate::memory::counters_address()
            }
        }
    };
}
