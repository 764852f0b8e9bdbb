//! End-to-end tests of the kernel live in tests/.
