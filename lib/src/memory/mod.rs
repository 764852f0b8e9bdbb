//! Probes of the live process: host allocator in use vs held, RSS, exact peak; CUDA pool; a simulated device budget.
