use serde::Serialize;

/// Per-sample costs of a layer, a block, a stage or a whole model.
///
/// Byte counts are for one sample at one [`Precision`](super::Precision);
/// a ledger multiplies them by the batch. Sums add up the layers; `workspace`,
/// `eval_live`, `largest_tensor` and `backward` are maxima because those
/// tensors live one layer at a time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Cost {
    /// Trainable parameters (elements).
    pub params: u64,
    /// Non-trainable state: batch-norm running mean and variance (elements).
    pub buffers: u64,
    /// Parameters that mixed precision casts to a half copy at every forward (conv and linear weights).
    pub amp_copy_params: u64,
    /// Multiply-accumulates of the forward pass.
    pub macs: u64,
    /// Bytes the autograd graph keeps alive until the loss is dropped.
    pub saved_bytes: u64,
    /// Scratch bytes a layer allocates and frees inside its forward (im2col columns).
    pub workspace_bytes: u64,
    /// Bytes alive at once while the layer runs without a graph (inference), its input included.
    pub eval_live_bytes: u64,
    /// The largest single activation tensor.
    pub largest_tensor_bytes: u64,
    /// Bytes a layer's backward holds at once beyond what the graph keeps:
    /// the incoming gradient, the op's own temporaries and the input gradient.
    pub backward_bytes: u64,
    /// Parameters that come before the first layer with that largest
    /// backward in forward order: their gradients are not yet made when it runs.
    pub params_before_largest_backward: u64,
    /// The largest parameter tensor (elements); the optimizer step works one tensor at a time.
    pub largest_param_elems: u64,
    /// Parameters that come before the first tensor of that largest size in
    /// forward order: backward makes their gradients after that tensor's.
    pub params_before_largest: u64,
    /// Parameters in tensors under [`SMALL_TENSOR_ELEMS`] elements (8-bit optimizers keep them in f32).
    pub small_tensor_params: u64,
    /// How many parameter tensors have at least [`SMALL_TENSOR_ELEMS`] elements.
    pub large_tensors: u64,
}

/// bitsandbytes' `min_8bit_size`: smaller tensors keep 32-bit optimizer state.
pub const SMALL_TENSOR_ELEMS: u64 = 4096;

impl Cost {
    /// The cost of running `self` and then `next`.
    pub fn then(self, next: Cost) -> Cost {
        Cost {
            params: self.params + next.params,
            buffers: self.buffers + next.buffers,
            amp_copy_params: self.amp_copy_params + next.amp_copy_params,
            macs: self.macs + next.macs,
            saved_bytes: self.saved_bytes + next.saved_bytes,
            workspace_bytes: self.workspace_bytes.max(next.workspace_bytes),
            eval_live_bytes: self.eval_live_bytes.max(next.eval_live_bytes),
            largest_tensor_bytes: self.largest_tensor_bytes.max(next.largest_tensor_bytes),
            backward_bytes: self.backward_bytes.max(next.backward_bytes),
            params_before_largest_backward: if next.backward_bytes > self.backward_bytes {
                self.params + next.params_before_largest_backward
            } else {
                self.params_before_largest_backward
            },
            largest_param_elems: self.largest_param_elems.max(next.largest_param_elems),
            params_before_largest: if next.largest_param_elems > self.largest_param_elems {
                self.params + next.params_before_largest
            } else {
                self.params_before_largest
            },
            small_tensor_params: self.small_tensor_params + next.small_tensor_params,
            large_tensors: self.large_tensors + next.large_tensors,
        }
    }

    /// Records one parameter tensor of `elems` elements.
    pub(crate) fn param_tensor(&mut self, elems: u64) {
        if elems > self.largest_param_elems {
            self.largest_param_elems = elems;
            self.params_before_largest = self.params;
        }
        self.params += elems;
        if elems < SMALL_TENSOR_ELEMS {
            self.small_tensor_params += elems;
        } else {
            self.large_tensors += 1;
        }
    }

    /// Records a tensor that the graph keeps until the loss is dropped.
    pub(crate) fn keep(&mut self, bytes: u64) {
        self.saved_bytes += bytes;
        self.largest_tensor_bytes = self.largest_tensor_bytes.max(bytes);
    }
}
