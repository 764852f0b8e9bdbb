//! A model of PyTorch's CUDA caching allocator on a simulated card, for
//! machines without a GPU: it reproduces lesson section 4.4, "enough memory
//! free in total, but no block large enough", and shows what `empty_cache()`
//! does and does not relieve.
//!
//! The rules are those of `c10/cuda/CUDACachingAllocator.cpp`
//! (`DeviceCachingAllocator::malloc`, `get_free_block`, `should_split`,
//! `alloc_block`, `free_block`, `release_cached_blocks`), with the constants
//! under their PyTorch names:
//!
//! - A request is rounded up to a multiple of 512 B (`kMinBlockSize`), and
//!   is never smaller than that (`round_size`).
//! - Requests of at most 1 MiB (`kSmallSize`) go to the small pool, whose
//!   segments are 2 MiB (`kSmallBuffer`). Larger ones go to the large pool:
//!   below 10 MiB (`kMinLargeAlloc`) a new segment is 20 MiB (`kLargeBuffer`),
//!   from 10 MiB on it is the request rounded up to 2 MiB (`kRoundLarge`)
//!   (`get_allocation_size`).
//! - A request takes the smallest free block of its pool that is large
//!   enough, the lowest address among equals (best fit), and splits it when
//!   the rest is at least 512 B (small pool) or more than 1 MiB (large pool);
//!   the rest stays a free block of the same segment.
//! - With `max_split_size` set (`PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`),
//!   blocks of at least that size are "oversize": never split, not given to
//!   a request below it, and given to a larger request only when they exceed
//!   it by less than `kLargeBuffer` (the default `max_non_split_rounding_mb`).
//! - When no cached block fits, the cache asks the device for a new segment
//!   (`cudaMalloc`). If the device has no room, it returns cached segments
//!   that are entirely free and asks again: first just enough oversize ones,
//!   when `max_split_size` is set (`release_available_cached_blocks`), then
//!   every one (`release_cached_blocks`); that last ask counts in
//!   `num_alloc_retries`. If it fails as well, the request is out of memory.
//! - A freed block merges with the free blocks next to it in its segment.
//!   Nothing goes back to the device until [`SimulatedCard::empty_cache`],
//!   which returns every segment that is one free block.
//!
//! So a cache request never fails while a whole free segment is cached: the
//! allocator returns those itself before giving up, and `empty_cache()`
//! cannot rescue it. What is left are free blocks inside segments that still
//! hold a live tensor, and those only freeing tensors can return.
//!
//! `empty_cache()` does help memory taken from the card without the cache
//! ([`SimulatedCard::allocate_outside`]): a library that calls `cudaMalloc`
//! itself (NCCL's buffers, for one) or another process on the same card.
//! Such memory needs room on the device and cannot use cached blocks, so the
//! cache's free memory blocks it until it is emptied.
//!
//! Where the model departs from PyTorch:
//!
//! - One device and one stream: no per-stream pools, no `record_stream`
//!   events that hold a freed block back, no CUDA-graph private pools.
//! - No expandable segments, `roundup_power2_divisions`,
//!   `garbage_collection_threshold` or free-memory callbacks.
//! - The device is a byte count: no CUDA context, no driver page
//!   granularity (outside allocations take exactly the bytes asked), and the
//!   device's own address space never fragments. Segment addresses are
//!   handed out in increasing order and never reused.
//! - `max_split_size` is in bytes and raised to at least `kLargeBuffer`,
//!   where PyTorch rejects a `max_split_size_mb` below 20.
//! - Releasing oversize blocks considers only whole free segments; PyTorch
//!   would also pick a split block there (which its `cudaFree` cannot take).
//! - The out-of-memory message names the rounded request and the segment it
//!   needed; PyTorch's names only the segment size (`alloc_size`).
//! - `num_ooms` counts the cache's failures, as PyTorch's does: a failing
//!   outside allocation is another library's error, not the cache's, and is
//!   counted apart (`num_outside_ooms`), which PyTorch does not.

use std::collections::HashMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::units::human;

const MIB: u64 = 1024 * 1024;

/// `kMinBlockSize`: every request is rounded up to a multiple of 512 B.
pub const MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest request of the small pool, 1 MiB.
pub const SMALL_SIZE: u64 = MIB;
/// `kSmallBuffer`: the size of a small-pool segment, 2 MiB.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// `kMinLargeAlloc`: large requests below 10 MiB get a `kLargeBuffer` segment.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// `kLargeBuffer`: the segment of a large request below `kMinLargeAlloc`, 20 MiB.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// `kRoundLarge`: larger requests get a segment of their size rounded up to 2 MiB.
pub const ROUND_LARGE: u64 = 2 * MIB;

/// `max_split_size` when it is not set: no block is oversize.
const UNLIMITED: u64 = u64::MAX;

/// The size a request occupies in the cache (`round_size`).
pub fn round_size(bytes: u64) -> u64 {
    bytes.max(MIN_BLOCK_SIZE).div_ceil(MIN_BLOCK_SIZE).saturating_mul(MIN_BLOCK_SIZE)
}

/// The segment the cache asks the device for when no cached block fits a
/// rounded request (`get_allocation_size`).
pub fn allocation_size(size: u64) -> u64 {
    if size <= SMALL_SIZE {
        SMALL_BUFFER
    } else if size < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        size.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

/// The two pools of cached blocks; a block never moves between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// Rounded requests of at most `kSmallSize`, in `kSmallBuffer` segments.
    Small,
    /// Everything larger.
    Large,
}

impl PoolKind {
    /// The pool of a rounded request (`get_pool`).
    pub fn for_size(size: u64) -> PoolKind {
        if size <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }
}

/// A live allocation on a simulated card, through the cache or outside it.
/// Numbered per card, from 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockId(u64);

impl fmt::Display for BlockId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A free block of the cache is one with no tensor.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Block {
    size: u64,
    tensor: Option<Tensor>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Tensor {
    id: BlockId,
    /// Bytes asked for, before rounding.
    requested: u64,
}

impl Block {
    fn is_free(&self) -> bool {
        self.tensor.is_none()
    }
}

/// One `cudaMalloc` of the cache: its blocks tile it in address order.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Segment {
    address: u64,
    pool: PoolKind,
    blocks: Vec<Block>,
}

impl Segment {
    fn size(&self) -> u64 {
        self.blocks.iter().map(|block| block.size).sum()
    }

    /// Only such a segment can go back to the device.
    fn is_free(&self) -> bool {
        matches!(self.blocks.as_slice(), [only] if only.is_free())
    }

    /// Merges the free block at `index` with free neighbours (`try_merge_blocks`).
    fn merge_around(&mut self, index: usize) {
        if self.blocks.get(index + 1).is_some_and(Block::is_free) {
            let next = self.blocks.remove(index + 1);
            self.blocks[index].size += next.size;
        }
        if index > 0 && self.blocks[index - 1].is_free() {
            let this = self.blocks.remove(index);
            self.blocks[index - 1].size += this.size;
        }
    }
}

/// Where a block is: indices into the card's segments and that segment's blocks.
#[derive(Debug, Clone, Copy)]
struct Spot {
    segment: usize,
    block: usize,
}

#[derive(Debug, Clone, Copy)]
struct FreeBlock {
    pool: PoolKind,
    size: u64,
    address: u64,
    spot: Spot,
}

/// A card of `capacity` bytes with PyTorch's caching allocator in front of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimulatedCard {
    capacity: u64,
    max_split_size: u64,
    /// In address order: a new segment always has the highest address.
    segments: Vec<Segment>,
    outside_allocations: HashMap<BlockId, u64>,
    next_id: u64,
    next_address: u64,
    allocated: u64,
    requested: u64,
    reserved: u64,
    outside: u64,
    peak_allocated: u64,
    peak_reserved: u64,
    num_ooms: u64,
    num_outside_ooms: u64,
    num_alloc_retries: u64,
}

impl SimulatedCard {
    /// An empty card; `capacity` is what this process may use of it.
    pub fn new(capacity: u64) -> SimulatedCard {
        SimulatedCard {
            capacity,
            max_split_size: UNLIMITED,
            segments: Vec::new(),
            outside_allocations: HashMap::new(),
            next_id: 0,
            next_address: 0,
            allocated: 0,
            requested: 0,
            reserved: 0,
            outside: 0,
            peak_allocated: 0,
            peak_reserved: 0,
            num_ooms: 0,
            num_outside_ooms: 0,
            num_alloc_retries: 0,
        }
    }

    /// `PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb`: blocks of at least
    /// `bytes` are oversize. Raised to `kLargeBuffer`, the least PyTorch accepts.
    pub fn with_max_split_size(self, bytes: u64) -> SimulatedCard {
        SimulatedCard { max_split_size: bytes.max(LARGE_BUFFER), ..self }
    }

    /// A tensor of `bytes` through the cache (`malloc`); 0 bytes take 512.
    pub fn allocate(&mut self, bytes: u64) -> Result<BlockId, PoolOom> {
        let size = round_size(bytes);
        let pool = PoolKind::for_size(size);
        match self.best_fit(pool, size).or_else(|| self.grow(pool, size)) {
            Some(spot) => Ok(self.occupy(spot, size, bytes)),
            None => {
                self.num_ooms += 1;
                Err(self.out_of_memory(size, false))
            }
        }
    }

    /// `bytes` straight from the device, bypassing the cache: it needs room
    /// on the device and cannot use cached free blocks.
    pub fn allocate_outside(&mut self, bytes: u64) -> Result<BlockId, PoolOom> {
        if self.device_free() < bytes {
            self.num_outside_ooms += 1;
            return Err(self.out_of_memory(bytes, true));
        }
        let id = self.new_id();
        self.outside += bytes;
        self.outside_allocations.insert(id, bytes);
        Ok(id)
    }

    /// Frees a tensor into the cache, or an outside allocation back to the device.
    pub fn free(&mut self, id: BlockId) -> Result<(), PoolError> {
        if let Some(bytes) = self.outside_allocations.remove(&id) {
            self.outside -= bytes;
            return Ok(());
        }
        let Some((spot, requested)) = self.find_tensor(id) else {
            return Err(if id.0 < self.next_id { PoolError::AlreadyFreed(id) } else { PoolError::Unknown(id) });
        };
        let segment = &mut self.segments[spot.segment];
        let block = &mut segment.blocks[spot.block];
        block.tensor = None;
        self.allocated -= block.size;
        self.requested -= requested;
        segment.merge_around(spot.block);
        Ok(())
    }

    /// `torch.cuda.empty_cache()`: returns every segment that is entirely
    /// free to the device; the bytes returned.
    pub fn empty_cache(&mut self) -> u64 {
        self.release_free_segments()
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            capacity: self.capacity,
            allocated: self.allocated,
            requested: self.requested,
            reserved: self.reserved,
            outside: self.outside,
            device_free: self.device_free(),
            cached_free: self.reserved - self.allocated,
            largest_free_block: self.free_blocks().map(|block| block.size).max().unwrap_or(0),
            segments: self.segments.len(),
            peak_allocated: self.peak_allocated,
            peak_reserved: self.peak_reserved,
            num_ooms: self.num_ooms,
            num_outside_ooms: self.num_outside_ooms,
            num_alloc_retries: self.num_alloc_retries,
        }
    }

    /// The cache's segments in address order, each with its blocks, for a picture.
    pub fn segments(&self) -> Vec<SegmentView> {
        self.segments
            .iter()
            .map(|segment| {
                let mut offset = 0;
                let blocks = segment
                    .blocks
                    .iter()
                    .map(|block| {
                        let view = BlockView {
                            offset,
                            size: block.size,
                            allocated: !block.is_free(),
                            id: block.tensor.map(|tensor| tensor.id),
                            requested: block.tensor.map_or(0, |tensor| tensor.requested),
                        };
                        offset += block.size;
                        view
                    })
                    .collect();
                SegmentView { address: segment.address, size: segment.size(), pool: segment.pool, blocks }
            })
            .collect()
    }

    fn device_free(&self) -> u64 {
        self.capacity.saturating_sub(self.reserved + self.outside)
    }

    fn new_id(&mut self) -> BlockId {
        let id = BlockId(self.next_id);
        self.next_id += 1;
        id
    }

    fn free_blocks(&self) -> impl Iterator<Item = FreeBlock> + '_ {
        self.segments.iter().enumerate().flat_map(|(segment_index, segment)| {
            let mut address = segment.address;
            segment.blocks.iter().enumerate().filter_map(move |(block_index, block)| {
                let free = block.is_free().then_some(FreeBlock {
                    pool: segment.pool,
                    size: block.size,
                    address,
                    spot: Spot { segment: segment_index, block: block_index },
                });
                address += block.size;
                free
            })
        })
    }

    fn find_tensor(&self, id: BlockId) -> Option<(Spot, u64)> {
        self.segments.iter().enumerate().find_map(|(segment_index, segment)| {
            segment.blocks.iter().enumerate().find_map(|(block_index, block)| {
                block
                    .tensor
                    .filter(|tensor| tensor.id == id)
                    .map(|tensor| (Spot { segment: segment_index, block: block_index }, tensor.requested))
            })
        })
    }

    /// `get_free_block`: the smallest fit decides, so when it is oversize
    /// for this request, every larger block is too.
    fn best_fit(&self, pool: PoolKind, size: u64) -> Option<Spot> {
        let best =
            self.free_blocks().filter(|block| block.pool == pool && block.size >= size).min_by_key(|block| (block.size, block.address))?;
        let oversize = best.size >= self.max_split_size;
        if size < self.max_split_size && oversize {
            return None;
        }
        if size >= self.max_split_size && best.size >= size.saturating_add(LARGE_BUFFER) {
            return None;
        }
        Some(best.spot)
    }

    /// The three `alloc_block` attempts of `malloc`, with cached segments
    /// returned to the device between them.
    fn grow(&mut self, pool: PoolKind, size: u64) -> Option<Spot> {
        let segment_size = allocation_size(size);
        if let Some(spot) = self.new_segment(pool, segment_size) {
            return Some(spot);
        }
        if self.release_oversize_segments(pool, size) {
            if let Some(spot) = self.new_segment(pool, segment_size) {
                return Some(spot);
            }
        }
        self.release_free_segments();
        self.num_alloc_retries += 1;
        self.new_segment(pool, segment_size)
    }

    /// `cudaMalloc` of a segment, when the device has room for it.
    fn new_segment(&mut self, pool: PoolKind, size: u64) -> Option<Spot> {
        if self.device_free() < size {
            return None;
        }
        let address = self.next_address;
        // Aligned like cudaMalloc's large allocations, so addresses read well in a picture.
        self.next_address = address.saturating_add(size.next_multiple_of(ROUND_LARGE));
        self.segments.push(Segment { address, pool, blocks: vec![Block { size, tensor: None }] });
        self.reserved += size;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
        Some(Spot { segment: self.segments.len() - 1, block: 0 })
    }

    /// Puts a tensor in the free block at `spot`, splitting off the rest
    /// when `should_split` allows (`alloc_found_block`).
    fn occupy(&mut self, spot: Spot, size: u64, bytes: u64) -> BlockId {
        let id = self.new_id();
        let max_split_size = self.max_split_size;
        let segment = &mut self.segments[spot.segment];
        let found = segment.blocks[spot.block].size;
        let rest = found - size;
        let split = match segment.pool {
            PoolKind::Small => rest >= MIN_BLOCK_SIZE,
            PoolKind::Large => size < max_split_size && rest > SMALL_SIZE,
        };
        if split {
            segment.blocks[spot.block].size = size;
            segment.blocks.insert(spot.block + 1, Block { size: rest, tensor: None });
        }
        let block = &mut segment.blocks[spot.block];
        block.tensor = Some(Tensor { id, requested: bytes });
        self.allocated += block.size;
        self.requested += bytes;
        self.peak_allocated = self.peak_allocated.max(self.allocated);
        id
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, returns
    /// the smallest free oversize segment that covers the request, or else
    /// the largest ones until they do; whether enough was returned.
    fn release_oversize_segments(&mut self, pool: PoolKind, size: u64) -> bool {
        if self.max_split_size == UNLIMITED {
            return false;
        }
        let target = size.max(self.max_split_size);
        let mut oversize: Vec<(u64, u64)> = self
            .segments
            .iter()
            .filter(|segment| segment.pool == pool && segment.is_free() && segment.size() >= self.max_split_size)
            .map(|segment| (segment.size(), segment.address))
            .collect();
        oversize.sort_unstable();
        if let Some(&(_, address)) = oversize.iter().find(|(segment_size, _)| *segment_size >= target) {
            self.release_segments(|segment| segment.address == address);
            return true;
        }
        let mut released = 0;
        for &(_, address) in oversize.iter().rev() {
            if released >= target {
                break;
            }
            released += self.release_segments(|segment| segment.address == address);
        }
        released >= target
    }

    /// `release_cached_blocks`: every segment that is one free block, both pools.
    fn release_free_segments(&mut self) -> u64 {
        self.release_segments(Segment::is_free)
    }

    fn release_segments(&mut self, release: impl Fn(&Segment) -> bool) -> u64 {
        let before = self.reserved;
        self.segments.retain(|segment| !release(segment));
        self.reserved = self.segments.iter().map(Segment::size).sum();
        before - self.reserved
    }

    fn out_of_memory(&self, requested: u64, outside_request: bool) -> PoolOom {
        let stats = self.stats();
        PoolOom {
            requested,
            capacity: stats.capacity,
            device_free: stats.device_free,
            allocated: stats.allocated,
            reserved: stats.reserved,
            outside: stats.outside,
            largest_free_block: stats.largest_free_block,
            releasable: self.segments.iter().filter(|segment| segment.is_free()).map(Segment::size).sum(),
            outside_request,
        }
    }
}

/// The state of a simulated card, in the terms of `torch.cuda.memory_stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStats {
    pub capacity: u64,
    /// Bytes of live blocks through the cache, rounded sizes: `memory_allocated`.
    pub allocated: u64,
    /// Bytes asked for by the live allocations through the cache, before rounding.
    pub requested: u64,
    /// Bytes of all segments: `memory_reserved`.
    pub reserved: u64,
    /// Bytes of live allocations outside the cache.
    pub outside: u64,
    /// `capacity - reserved - outside`: what the device can still hand out.
    pub device_free: u64,
    /// `reserved - allocated`: free blocks inside the cache.
    pub cached_free: u64,
    /// The largest free block inside the cache.
    pub largest_free_block: u64,
    pub segments: usize,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Requests through the cache that ran out of memory.
    pub num_ooms: u64,
    /// Requests from outside the cache that found too little free on the device.
    pub num_outside_ooms: u64,
    /// Segment requests retried after returning every whole free segment.
    pub num_alloc_retries: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "allocated {} | reserved {} | largest free block {} | device free {}",
            human(self.allocated),
            human(self.reserved),
            human(self.largest_free_block),
            human(self.device_free)
        )
    }
}

/// One segment of the cache, for drawing it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentView {
    /// In the simulated card's address space.
    pub address: u64,
    pub size: u64,
    pub pool: PoolKind,
    /// In address order; together they tile the segment.
    pub blocks: Vec<BlockView>,
}

/// One block of a segment: a tensor's, or free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockView {
    /// From the start of the segment.
    pub offset: u64,
    pub size: u64,
    pub allocated: bool,
    /// The tensor's id, when allocated.
    pub id: Option<BlockId>,
    /// Bytes the tensor asked for (0 when free).
    pub requested: u64,
}

/// An allocation the simulated card could not serve, with the card's state
/// at that moment, like PyTorch's `OutOfMemoryError`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
pub struct PoolOom {
    /// Bytes asked for: rounded by `round_size` for a request through the cache.
    pub requested: u64,
    pub capacity: u64,
    pub device_free: u64,
    pub allocated: u64,
    pub reserved: u64,
    pub outside: u64,
    pub largest_free_block: u64,
    /// What `empty_cache()` would return now: the cached segments that are
    /// entirely free (none after a failed request through the cache, which
    /// returns them before failing).
    pub releasable: u64,
    /// The request came from outside the cache.
    pub outside_request: bool,
}

impl PoolOom {
    /// Free on the device plus free inside the cache.
    pub fn free_in_total(&self) -> u64 {
        self.device_free + self.cached_free()
    }

    /// The memory was there in total, only not in one piece that fits.
    pub fn fragmented(&self) -> bool {
        self.free_in_total() >= self.requested
    }

    fn cached_free(&self) -> u64 {
        self.reserved - self.allocated
    }
}

impl fmt::Display for PoolOom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let segment = allocation_size(self.requested);
        write!(f, "out of memory (simulated card): tried to allocate {}", human(self.requested))?;
        if self.outside_request {
            write!(f, " outside the cache")?;
        } else if segment != self.requested {
            write!(f, " (a new {} segment)", human(segment))?;
        }
        write!(
            f,
            "; the card has a total capacity of {} of which {} is free; {} allocated by tensors, {} reserved by the cache \
             ({} reserved but unallocated, largest free block {}); {} outside the cache.",
            human(self.capacity),
            human(self.device_free),
            human(self.allocated),
            human(self.reserved),
            human(self.cached_free()),
            human(self.largest_free_block),
            human(self.outside)
        )?;
        if !self.fragmented() {
            return Ok(());
        }
        write!(f, " That is {} free in total, more than the request, but ", human(self.free_in_total()))?;
        if self.outside_request {
            write!(f, "{} of it is free inside the cache, which an allocation from outside cannot use. ", human(self.cached_free()))?;
            if self.releasable == 0 {
                write!(f, "empty_cache() would return nothing: every cached segment still holds a live tensor, and only freeing tensors lets one go back.")
            } else if self.device_free + self.releasable >= self.requested {
                write!(f, "empty_cache() would return {} of it to the card, enough for this request.", human(self.releasable))
            } else {
                write!(
                    f,
                    "empty_cache() would return {} of it to the card, not enough: the rest lies in segments that still hold live tensors.",
                    human(self.releasable)
                )
            }
        } else {
            write!(
                f,
                "not in one piece: no free block inside the cache is large enough, and the card has no room for a new {} segment. \
                 empty_cache() would not help: the cache has already returned every segment that was entirely free. \
                 Freeing live tensors lets their blocks merge and their segments go back; max_split_size \
                 (PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb) or fewer distinct tensor sizes make such pieces rarer.",
                human(segment)
            )
        }
    }
}

/// A `free` the card cannot do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, thiserror::Error)]
pub enum PoolError {
    #[error("free: block {0} was never allocated on this card")]
    Unknown(BlockId),
    #[error("free: block {0} is already free")]
    AlreadyFreed(BlockId),
}

/// What [`fragmentation_demo`] did.
#[derive(Debug, Clone, Serialize)]
pub struct FragmentationDemo {
    pub capacity: u64,
    /// The large tensor the story ends with.
    pub request: u64,
    /// The card after each step.
    pub steps: Vec<(String, PoolStats)>,
    /// Why the large tensor did not fit.
    pub oom: Option<PoolOom>,
    /// What `empty_cache()` returned after that failure.
    pub released_by_empty_cache: u64,
    /// The same request again after `empty_cache()`.
    pub oom_after_empty_cache: Option<PoolOom>,
    /// Whether the request fit once the tensors pinning the segments were freed.
    pub fits_after_freeing_tensors: bool,
}

/// A training loop that fragments the cache: full-size activations are
/// freed, smaller ones reuse their segments with a kept tensor beside each,
/// and a large tensor then fails with far more than its size free in total.
///
/// Sizes are in units of `capacity / 1024` (1 MiB on a 1 GiB card): weights
/// 100, eight activations of 100, then eight of 70 each with a 20 kept for
/// gradient accumulation, and a request of 200. The story holds on cards of
/// 256 MiB and more; on smaller ones the rounding of segments to 2 MiB leaves
/// room that changes it, and the demo records what the model did instead.
pub fn fragmentation_demo(capacity: u64) -> FragmentationDemo {
    let unit = capacity / 1024;
    let request = 200 * unit;
    let mut script = Script::new(capacity);

    script.allocate(100 * unit);
    script.record(format!("weights: {}", human(100 * unit)));
    let activations = script.allocate_many(8, 100 * unit);
    script.record(format!("forward at full size: 8 activations of {}", human(100 * unit)));
    script.free(activations);
    script.record("backward frees the activations: their segments stay cached".to_owned());

    let mut smaller = Vec::new();
    let mut kept = Vec::new();
    for _ in 0..8 {
        smaller.push(script.allocate(70 * unit));
        kept.push(script.allocate(20 * unit));
    }
    script.record(format!(
        "forward on smaller crops: 8 activations of {}, each with {} kept for gradient accumulation",
        human(70 * unit),
        human(20 * unit)
    ));
    script.free(smaller);
    script.record(format!("backward frees the {} activations; the kept tensors stay in their segments", human(70 * unit)));

    let oom = script.card.allocate(request).err();
    script.record(format!("allocate {}: {}", human(request), outcome(oom.is_none())));
    let released_by_empty_cache = script.card.empty_cache();
    let oom_after_empty_cache = script.card.allocate(request).err();
    script.record(format!(
        "empty_cache() returns {}, then allocate {} again: {}",
        human(released_by_empty_cache),
        human(request),
        outcome(oom_after_empty_cache.is_none())
    ));

    script.free(kept);
    let fits_after_freeing_tensors = script.allocate(request).is_some();
    script.record(format!("free the kept tensors, then allocate {}: {}", human(request), outcome(fits_after_freeing_tensors)));

    FragmentationDemo {
        capacity,
        request,
        steps: script.steps,
        oom,
        released_by_empty_cache,
        oom_after_empty_cache,
        fits_after_freeing_tensors,
    }
}

/// What [`empty_cache_demo`] did.
#[derive(Debug, Clone, Serialize)]
pub struct EmptyCacheDemo {
    pub capacity: u64,
    /// The allocation from outside the cache.
    pub request: u64,
    /// The card after each step.
    pub steps: Vec<(String, PoolStats)>,
    /// Why the outside allocation failed while the memory was cached.
    pub oom: Option<PoolOom>,
    pub before_empty_cache: PoolStats,
    /// What `empty_cache()` returned.
    pub released: u64,
    pub after_empty_cache: PoolStats,
    /// Whether the same outside allocation fit after `empty_cache()`.
    pub fits_after_empty_cache: bool,
}

/// Freed activations stay cached; another process (or a library that calls
/// `cudaMalloc` itself) then cannot get memory the card has free in total,
/// until `empty_cache()` returns the cached segments.
///
/// Sizes are in units of `capacity / 1024` (1 MiB on a 1 GiB card): weights
/// 100, six activations of 120, and an outside request of 300.
pub fn empty_cache_demo(capacity: u64) -> EmptyCacheDemo {
    let unit = capacity / 1024;
    let request = 300 * unit;
    let mut script = Script::new(capacity);

    script.allocate(100 * unit);
    script.record(format!("weights: {}", human(100 * unit)));
    let activations = script.allocate_many(6, 120 * unit);
    script.record(format!("forward: 6 activations of {}", human(120 * unit)));
    script.free(activations);
    script.record("backward frees the activations: their segments stay cached".to_owned());

    let oom = script.card.allocate_outside(request).err();
    script.record(format!("another process asks for {}: {}", human(request), outcome(oom.is_none())));
    let before_empty_cache = script.card.stats();
    let released = script.card.empty_cache();
    let after_empty_cache = script.card.stats();
    script.record(format!("empty_cache() returns {}", human(released)));
    let fits_after_empty_cache = script.card.allocate_outside(request).is_ok();
    script.record(format!("it asks for {} again: {}", human(request), outcome(fits_after_empty_cache)));

    EmptyCacheDemo { capacity, request, steps: script.steps, oom, before_empty_cache, released, after_empty_cache, fits_after_empty_cache }
}

fn outcome(fits: bool) -> &'static str {
    if fits {
        "fits"
    } else {
        "out of memory"
    }
}

/// A demo's card and the stats it recorded. A tensor that does not fit is
/// left out (its step's stats show it), so a demo always runs to its end.
struct Script {
    card: SimulatedCard,
    steps: Vec<(String, PoolStats)>,
}

impl Script {
    fn new(capacity: u64) -> Script {
        Script { card: SimulatedCard::new(capacity), steps: Vec::new() }
    }

    fn allocate(&mut self, bytes: u64) -> Option<BlockId> {
        self.card.allocate(bytes).ok()
    }

    fn allocate_many(&mut self, count: usize, bytes: u64) -> Vec<Option<BlockId>> {
        (0..count).map(|_| self.allocate(bytes)).collect()
    }

    fn free(&mut self, ids: Vec<Option<BlockId>>) {
        for id in ids.into_iter().flatten() {
            let freed = self.card.free(id);
            debug_assert!(freed.is_ok(), "a demo frees only tensors it holds");
        }
    }

    fn record(&mut self, label: String) {
        self.steps.push((label, self.card.stats()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1024 * MIB;

    fn blocks(card: &SimulatedCard, segment: usize) -> Vec<(u64, bool)> {
        card.segments()[segment].blocks.iter().map(|block| (block.size, block.allocated)).collect()
    }

    #[test]
    fn rounding_and_pool_choice() {
        assert_eq!(round_size(0), 512);
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);

        let mut card = SimulatedCard::new(GIB);
        card.allocate(0).unwrap();
        card.allocate(1).unwrap();
        let stats = card.stats();
        assert_eq!((stats.allocated, stats.requested, stats.reserved, stats.segments), (1024, 1, SMALL_BUFFER, 1));

        let cases = [
            (MIB, PoolKind::Small, 2 * MIB),
            (MIB + 1, PoolKind::Large, 20 * MIB),
            (5 * MIB, PoolKind::Large, 20 * MIB),
            (11 * MIB, PoolKind::Large, 12 * MIB),
        ];
        for (bytes, pool, segment) in cases {
            let mut card = SimulatedCard::new(GIB);
            card.allocate(bytes).unwrap();
            let segments = card.segments();
            assert_eq!(segments.len(), 1, "{bytes} B");
            assert_eq!((segments[0].pool, segments[0].size), (pool, segment), "{bytes} B");
            assert_eq!(card.stats().reserved, segment);
        }
    }

    #[test]
    fn best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address() {
        let mut card = SimulatedCard::new(GIB);
        let ids: Vec<BlockId> = [30, 20, 40, 20].iter().map(|mib| card.allocate(mib * MIB).unwrap()).collect();
        for id in ids {
            card.free(id).unwrap();
        }
        card.allocate(15 * MIB).unwrap();
        assert_eq!(blocks(&card, 1), vec![(15 * MIB, true), (5 * MIB, false)], "the first 20 MiB segment");
        assert_eq!(blocks(&card, 3), vec![(20 * MIB, false)], "the second 20 MiB segment is untouched");
        card.allocate(25 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(25 * MIB, true), (5 * MIB, false)]);
        assert_eq!(card.stats().segments, 4, "both served from the cache");
    }

    #[test]
    fn a_large_block_splits_only_when_more_than_a_mebibyte_is_left() {
        let mut card = SimulatedCard::new(GIB);
        card.allocate(5 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(5 * MIB, true), (15 * MIB, false)]);

        let mut card = SimulatedCard::new(GIB);
        card.allocate(11 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(12 * MIB, true)], "1 MiB left is not split off");
        assert_eq!((card.stats().allocated, card.stats().requested), (12 * MIB, 11 * MIB));

        let mut card = SimulatedCard::new(GIB);
        card.allocate(11 * MIB - 512).unwrap();
        assert_eq!(blocks(&card, 0), vec![(11 * MIB - 512, true), (MIB + 512, false)]);
    }

    #[test]
    fn a_small_block_splits_down_to_512_bytes() {
        let mut card = SimulatedCard::new(GIB);
        card.allocate(MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(MIB, true), (MIB, false)]);
        card.allocate(MIB - 512).unwrap();
        assert_eq!(blocks(&card, 0), vec![(MIB, true), (MIB - 512, true), (512, false)]);
        card.allocate(100).unwrap();
        assert_eq!(blocks(&card, 0), vec![(MIB, true), (MIB - 512, true), (512, true)]);
        assert_eq!(card.stats().segments, 1);
    }

    #[test]
    fn freed_neighbours_merge_in_any_order() {
        let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        for order in orders {
            let mut card = SimulatedCard::new(GIB);
            let ids: Vec<BlockId> = (0..3).map(|_| card.allocate(5 * MIB).unwrap()).collect();
            assert_eq!(blocks(&card, 0), vec![(5 * MIB, true), (5 * MIB, true), (5 * MIB, true), (5 * MIB, false)]);
            for index in order {
                card.free(ids[index]).unwrap();
            }
            assert_eq!(blocks(&card, 0), vec![(20 * MIB, false)], "order {order:?}");
            assert_eq!(card.stats().largest_free_block, 20 * MIB);
        }
    }

    #[test]
    fn a_miss_returns_whole_free_segments_and_retries() {
        let mut card = SimulatedCard::new(100 * MIB);
        let small = card.allocate(1000).unwrap();
        let big = card.allocate(60 * MIB).unwrap();
        card.free(small).unwrap();
        card.free(big).unwrap();
        assert_eq!(card.stats().reserved, 62 * MIB, "freeing returns nothing to the device");

        card.allocate(80 * MIB).unwrap();
        let stats = card.stats();
        assert_eq!(stats.num_alloc_retries, 1);
        assert_eq!(stats.num_ooms, 0);
        assert_eq!((stats.reserved, stats.segments, stats.allocated), (80 * MIB, 1, 80 * MIB), "both pools were released");
        assert_eq!(stats.peak_reserved, 80 * MIB, "62 MiB went back before the 80 MiB segment came");
    }

    /// Two segments, each with a tensor pinning it and 14 MiB free beside it.
    fn pinned_card() -> (SimulatedCard, BlockId, BlockId) {
        let mut card = SimulatedCard::new(100 * MIB);
        let first = card.allocate(44 * MIB).unwrap();
        let second = card.allocate(44 * MIB).unwrap();
        card.free(first).unwrap();
        card.free(second).unwrap();
        let a = card.allocate(30 * MIB).unwrap();
        let b = card.allocate(30 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(30 * MIB, true), (14 * MIB, false)]);
        assert_eq!(blocks(&card, 1), vec![(30 * MIB, true), (14 * MIB, false)]);
        (card, a, b)
    }

    #[test]
    fn fragmented_memory_fails_and_empty_cache_cannot_fix_it() {
        let (mut card, a, _) = pinned_card();
        let oom = card.allocate(36 * MIB).unwrap_err();
        assert!(oom.fragmented());
        assert!(!oom.outside_request);
        assert_eq!(oom.requested, 36 * MIB);
        assert_eq!(oom.free_in_total(), 40 * MIB);
        assert_eq!((oom.device_free, oom.largest_free_block, oom.releasable), (12 * MIB, 14 * MIB, 0));
        let stats = card.stats();
        assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 1));
        assert_eq!((stats.allocated, stats.reserved, stats.cached_free), (60 * MIB, 88 * MIB, 28 * MIB));

        let message = oom.to_string();
        assert!(message.starts_with("out of memory (simulated card): tried to allocate 36.0 MiB;"), "{message}");
        assert!(message.contains("total capacity of 100 MiB of which 12.0 MiB is free"), "{message}");
        assert!(message.contains("60.0 MiB allocated by tensors, 88.0 MiB reserved by the cache (28.0 MiB reserved but unallocated, largest free block 14.0 MiB)"), "{message}");
        assert!(message.contains("40.0 MiB free in total"), "{message}");
        assert!(message.contains("max_split_size"), "{message}");
        assert!(message.contains("empty_cache() would not help"), "{message}");

        assert_eq!(card.empty_cache(), 0, "every segment is still partly in use");
        assert!(card.allocate(36 * MIB).unwrap_err().fragmented());
        assert_eq!(card.stats().num_ooms, 2);

        card.free(a).unwrap();
        card.allocate(36 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(36 * MIB, true), (8 * MIB, false)], "served from the freed segment");
    }

    #[test]
    fn an_outside_allocation_fails_with_enough_cached_then_fits_after_empty_cache() {
        let mut card = SimulatedCard::new(100 * MIB);
        let a = card.allocate(30 * MIB).unwrap();
        let b = card.allocate(30 * MIB).unwrap();
        card.free(a).unwrap();
        card.free(b).unwrap();

        let oom = card.allocate_outside(50 * MIB).unwrap_err();
        assert!(oom.outside_request);
        assert!(oom.fragmented(), "60 MiB cached and 40 MiB on the device");
        assert_eq!((oom.requested, oom.device_free, oom.releasable), (50 * MIB, 40 * MIB, 60 * MIB));
        assert_eq!(card.stats().num_ooms, 0, "not the cache's failure");
        assert_eq!(card.stats().num_outside_ooms, 1);
        let message = oom.to_string();
        assert!(message.contains("tried to allocate 50.0 MiB outside the cache"), "{message}");
        assert!(message.contains("empty_cache() would return 60.0 MiB of it to the card, enough for this request"), "{message}");

        assert_eq!(card.empty_cache(), 60 * MIB);
        let outside = card.allocate_outside(50 * MIB).unwrap();
        let stats = card.stats();
        assert_eq!((stats.outside, stats.reserved, stats.device_free), (50 * MIB, 0, 50 * MIB));

        card.free(outside).unwrap();
        assert_eq!((card.stats().outside, card.stats().device_free), (0, 100 * MIB), "back to the device at once");
    }

    #[test]
    fn outside_memory_takes_room_from_new_segments() {
        let mut card = SimulatedCard::new(100 * MIB);
        card.allocate_outside(90 * MIB).unwrap();
        let oom = card.allocate(20 * MIB).unwrap_err();
        assert!(!oom.fragmented());
        assert_eq!((oom.outside, oom.device_free), (90 * MIB, 10 * MIB));
        assert!(!oom.to_string().contains("in total"));
    }

    #[test]
    fn an_outside_request_blocked_by_pinned_segments_is_told_so() {
        let (mut card, _, _) = pinned_card();
        let oom = card.allocate_outside(30 * MIB).unwrap_err();
        assert!(oom.fragmented());
        assert_eq!(oom.releasable, 0);
        assert!(oom.to_string().contains("empty_cache() would return nothing"), "{oom}");
        assert_eq!(card.empty_cache(), 0);
    }

    #[test]
    fn freeing_an_unknown_or_freed_id_is_an_error() {
        let mut card = SimulatedCard::new(GIB);
        let id = card.allocate(MIB).unwrap();
        let outside = card.allocate_outside(MIB).unwrap();
        assert_eq!(card.free(BlockId(7)), Err(PoolError::Unknown(BlockId(7))));
        card.free(id).unwrap();
        card.free(outside).unwrap();
        assert_eq!(card.free(id), Err(PoolError::AlreadyFreed(id)));
        assert_eq!(card.free(outside), Err(PoolError::AlreadyFreed(outside)));
        assert_eq!(PoolError::AlreadyFreed(id).to_string(), "free: block #0 is already free");
        assert_eq!(PoolError::Unknown(BlockId(7)).to_string(), "free: block #7 was never allocated on this card");
    }

    #[test]
    fn max_split_size_keeps_large_blocks_whole() {
        let mut plain = SimulatedCard::new(GIB);
        let id = plain.allocate(100 * MIB).unwrap();
        plain.free(id).unwrap();
        plain.allocate(30 * MIB).unwrap();
        assert_eq!(blocks(&plain, 0), vec![(30 * MIB, true), (70 * MIB, false)], "unlimited: the block is split");

        let mut card = SimulatedCard::new(GIB).with_max_split_size(40 * MIB);
        let id = card.allocate(100 * MIB).unwrap();
        card.free(id).unwrap();
        card.allocate(30 * MIB).unwrap();
        assert_eq!(card.stats().segments, 2, "a request below max_split_size is not served from an oversize block");
        assert_eq!(blocks(&card, 0), vec![(100 * MIB, false)]);

        card.allocate(90 * MIB).unwrap();
        assert_eq!(blocks(&card, 0), vec![(100 * MIB, true)], "oversize: given whole, never split");
        assert_eq!(card.stats().allocated, 130 * MIB);

        let mut card = SimulatedCard::new(GIB).with_max_split_size(40 * MIB);
        let id = card.allocate(100 * MIB).unwrap();
        card.free(id).unwrap();
        card.allocate(50 * MIB).unwrap();
        assert_eq!(card.stats().segments, 2, "100 MiB exceeds a 50 MiB request by kLargeBuffer or more");
    }

    #[test]
    fn max_split_size_is_at_least_k_large_buffer() {
        let mut card = SimulatedCard::new(GIB).with_max_split_size(MIB);
        let id = card.allocate(12 * MIB).unwrap();
        card.free(id).unwrap();
        card.allocate(11 * MIB).unwrap();
        assert_eq!(card.stats().segments, 1, "a 12 MiB block is not oversize");

        let id = card.allocate(5 * MIB).unwrap();
        assert_eq!(blocks(&card, 1), vec![(5 * MIB, true), (15 * MIB, false)], "a fresh segment is split all the same");
        card.free(id).unwrap();
        card.allocate(5 * MIB).unwrap();
        assert_eq!(card.stats().segments, 3, "at max_split_size = kLargeBuffer a whole 20 MiB block is oversize");
    }

    #[test]
    fn oversize_segments_are_released_first_without_a_retry() {
        let mut card = SimulatedCard::new(150 * MIB).with_max_split_size(40 * MIB);
        let small = card.allocate(MIB).unwrap();
        let big = card.allocate(100 * MIB).unwrap();
        card.free(small).unwrap();
        card.free(big).unwrap();
        card.allocate(30 * MIB).unwrap();
        card.allocate(30 * MIB).unwrap();
        let stats = card.stats();
        assert_eq!(stats.num_alloc_retries, 0, "release_available_cached_blocks was enough");
        assert_eq!((stats.reserved, stats.segments), (62 * MIB, 3), "the small pool's free segment stays");
    }

    #[test]
    fn stats_display_is_one_line() {
        let mut card = SimulatedCard::new(GIB);
        card.allocate(5 * MIB).unwrap();
        assert_eq!(card.stats().to_string(), "allocated 5.00 MiB | reserved 20.0 MiB | largest free block 15.0 MiB | device free 1004 MiB");
    }

    #[test]
    fn segments_tile_their_address_range() {
        let mut card = SimulatedCard::new(GIB);
        let a = card.allocate(5 * MIB).unwrap();
        card.allocate(3000).unwrap();
        card.allocate(30 * MIB).unwrap();
        let segments = card.segments();
        assert_eq!(segments.iter().map(|segment| segment.pool).collect::<Vec<_>>(), [PoolKind::Large, PoolKind::Small, PoolKind::Large]);
        for pair in segments.windows(2) {
            assert!(pair[0].address + pair[0].size <= pair[1].address);
        }
        for segment in &segments {
            let mut offset = 0;
            for block in &segment.blocks {
                assert_eq!(block.offset, offset);
                offset += block.size;
            }
            assert_eq!(offset, segment.size);
        }
        let first = segments[0].blocks[0];
        assert_eq!((first.id, first.requested, first.allocated), (Some(a), 5 * MIB, true));
        let json = serde_json::to_value(&segments[0]).unwrap();
        assert_eq!(json["pool"], "large");
        assert_eq!(json["blocks"][1]["id"], serde_json::Value::Null);
    }

    #[test]
    fn fragmentation_demo_ends_out_of_memory_with_more_than_enough_free() {
        let demo = fragmentation_demo(GIB);
        let oom = demo.oom.clone().unwrap();
        assert_eq!(demo.request, 200 * MIB);
        assert!(oom.fragmented());
        assert_eq!((oom.device_free, oom.largest_free_block, oom.free_in_total()), (124 * MIB, 70 * MIB, 764 * MIB));
        assert_eq!((oom.allocated, oom.reserved), (260 * MIB, 900 * MIB));
        assert_eq!(demo.released_by_empty_cache, 0);
        assert!(demo.oom_after_empty_cache.as_ref().unwrap().fragmented());
        assert!(demo.fits_after_freeing_tensors);
        let (_, last) = demo.steps.last().unwrap();
        assert_eq!((last.reserved, last.allocated, last.num_ooms, last.num_alloc_retries), (300 * MIB, 300 * MIB, 2, 3));
        assert_eq!(last.peak_reserved, 900 * MIB);
        assert_eq!(demo.steps.len(), 8);
        serde_json::to_string(&demo).unwrap();

        for capacity in [256 * MIB, 1000 * MIB, 3 * GIB + 12345, 24 * GIB, 80 * GIB] {
            let demo = fragmentation_demo(capacity);
            assert!(demo.oom.as_ref().is_some_and(PoolOom::fragmented), "{capacity}");
            assert!(demo.oom_after_empty_cache.is_some() && demo.fits_after_freeing_tensors, "{capacity}");
            assert_eq!(demo.released_by_empty_cache, 0, "{capacity}");
        }
    }

    #[test]
    fn empty_cache_demo_fits_after_empty_cache() {
        let demo = empty_cache_demo(GIB);
        let oom = demo.oom.clone().unwrap();
        assert!(oom.outside_request && oom.fragmented());
        assert_eq!((oom.requested, oom.device_free, oom.releasable), (300 * MIB, 204 * MIB, 720 * MIB));
        assert_eq!(demo.released, 720 * MIB);
        assert_eq!((demo.before_empty_cache.reserved, demo.after_empty_cache.reserved), (820 * MIB, 100 * MIB));
        assert_eq!(demo.after_empty_cache.device_free, 924 * MIB);
        assert!(demo.fits_after_empty_cache);
        let (_, last) = demo.steps.last().unwrap();
        assert_eq!((last.outside, last.device_free), (300 * MIB, 624 * MIB));
        serde_json::to_string(&demo).unwrap();

        for capacity in [256 * MIB, 1000 * MIB, 3 * GIB + 12345, 24 * GIB, 80 * GIB] {
            let demo = empty_cache_demo(capacity);
            assert!(demo.oom.as_ref().is_some_and(PoolOom::fragmented), "{capacity}");
            assert!(demo.fits_after_empty_cache, "{capacity}");
        }
    }
}
