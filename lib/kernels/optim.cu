// Multi-tensor optimizer updates on CUDA: one launch updates every parameter
// of a model. Each block takes `chunk` consecutive elements of one tensor;
// the tensor is found by a binary search over the entries' first blocks.
// The arithmetic is the CPU's fused updates' (lib/src/train/optim/sgd.rs and
// adam.rs), compiled with -fmad=false so that no product is fused into an
// add where the CPU rounds it first.

struct Entry {
    float* param;
    const float* grad;
    float* state[3];
    unsigned long long len;
    unsigned long long first_block;
    float step_size;
    float bias_correction2_sqrt;
    unsigned int first;
    unsigned int reserved;
};

__device__ int entry_of_block(const Entry* entries, int count, unsigned long long block) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (entries[mid].first_block <= block) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// torch.lerp as its CPU kernel computes it (exact at both ends).
__device__ float lerp(float start, float end, float weight) {
    return fabsf(weight) < 0.5f ? start + weight * (end - start) : end - (end - start) * (1.0f - weight);
}

// SGD with momentum, dampening (`keep` is 1 - dampening), weight decay and
// Nesterov, as torch.optim.SGD; state[0] is the momentum buffer, which an
// entry's first step sets to the (decayed) gradient.
extern "C" __global__ void sgd_f32(const Entry* entries, int count, unsigned long long chunk, float lr, float momentum,
                                   float keep, float weight_decay, int nesterov) {
    const Entry e = entries[entry_of_block(entries, count, blockIdx.x)];
    unsigned long long start = (blockIdx.x - e.first_block) * chunk;
    unsigned long long end = start + chunk < e.len ? start + chunk : e.len;
    for (unsigned long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float p = e.param[i];
        float d = weight_decay != 0.0f ? e.grad[i] + weight_decay * p : e.grad[i];
        if (momentum != 0.0f) {
            float b = e.first ? d : e.state[0][i] * momentum + keep * d;
            e.state[0][i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        e.param[i] = p + -lr * d;
    }
}

// Adam and AdamW, as torch.optim.Adam/AdamW's single-tensor path: state[0] the
// first moment, state[1] the second, state[2] its running maximum (AMSGrad),
// each entry with its own step's bias corrections. The constants come rounded
// to f32 as the CPU's `AdamStep` rounds them. Every kernel takes its float
// arguments before its int ones (lib/src/train/optim/multi.rs pushes them so).
extern "C" __global__ void adam_f32(const Entry* entries, int count, unsigned long long chunk, float one_minus_beta1,
                                    float beta2, float one_minus_beta2, float eps, float weight_decay, float shrink,
                                    int decoupled, int amsgrad) {
    const Entry e = entries[entry_of_block(entries, count, blockIdx.x)];
    unsigned long long start = (blockIdx.x - e.first_block) * chunk;
    unsigned long long end = start + chunk < e.len ? start + chunk : e.len;
    for (unsigned long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        float p = e.param[i];
        float g = !decoupled && weight_decay != 0.0f ? e.grad[i] + weight_decay * p : e.grad[i];
        float m = lerp(e.state[0][i], g, one_minus_beta1);
        float v = e.state[1][i] * beta2 + one_minus_beta2 * g * g;
        e.state[0][i] = m;
        e.state[1][i] = v;
        if (amsgrad) {
            float most = e.state[2][i];
            if (isnan(v) || v > most) {
                most = v;
            }
            e.state[2][i] = most;
            v = most;
        }
        e.param[i] = p * shrink + -e.step_size * m / (sqrtf(v) / e.bias_correction2_sqrt + eps);
    }
}
