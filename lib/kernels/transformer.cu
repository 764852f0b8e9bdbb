// The vision transformer's elementwise and row-wise passes on CUDA, where no
// cuDNN or cuBLAS call fits: GELU with the error function and layer-norm
// over the last dimension, forward and backward, for maps in f32, f16 and
// bf16 (each computed in f32 and stored once in its own type; layer-norm's
// weight, bias and their gradients are f32). Their arithmetic is the
// CPU ops' (lib/src/ops/gelu.rs, layer_norm.rs); lib/src/ops/cuda/reference.rs
// computes what each kernel computes on the host, for the test command.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float load(float v) { return v; }
__device__ __forceinline__ float load(__half v) { return __half2float(v); }
__device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T store(float v);
template <> __device__ __forceinline__ float store<float>(float v) { return v; }
template <> __device__ __forceinline__ __half store<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 store<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

#define FRAC_1_SQRT_2 0.70710678118654752440f
#define NORMAL_DENSITY_AT_0 0.39894228040143267794f

// y = x/2 (1 + erf(x / sqrt 2)) over n elements.
template <typename T> __device__ void gelu(const T* x, T* y, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        float v = load(x[i]);
        y[i] = store<T>(0.5f * v * (1.0f + erff(v * FRAC_1_SQRT_2)));
    }
}

// dx = dy (Phi(x) + x phi(x)) over n elements; dx may be dy.
template <typename T> __device__ void gelu_backward(const T* x, const T* dy, T* dx, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        float v = load(x[i]);
        float cdf = 0.5f * (1.0f + erff(v * FRAC_1_SQRT_2));
        float density = NORMAL_DENSITY_AT_0 * expf(-0.5f * v * v);
        dx[i] = store<T>(load(dy[i]) * (cdf + v * density));
    }
}

// The sum of every thread's `v` in a block of a power-of-two size, on all threads.
__device__ float block_sum(float v, float* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            shared[threadIdx.x] += shared[threadIdx.x + half];
        }
        __syncthreads();
    }
    float total = shared[0];
    __syncthreads();
    return total;
}

// One row's mean and 1 / sqrt(var + eps), the variance from the centred values.
template <typename T> __device__ float2 row_statistics(const T* row, unsigned int d, float eps, float* shared) {
    float sum = 0.0f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) sum += load(row[i]);
    float mean = block_sum(sum, shared) / d;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        float c = load(row[i]) - mean;
        squares += c * c;
    }
    float var = block_sum(squares, shared) / d;
    return make_float2(mean, rsqrtf(var + eps));
}

// y = (x - mean) rstd w + b per row of d features; one block a row.
template <typename T>
__device__ void layer_norm(const T* x, const float* w, const float* b, T* y, unsigned int d, float eps) {
    extern __shared__ float shared[];
    const T* row = x + (unsigned long long)blockIdx.x * d;
    T* out = y + (unsigned long long)blockIdx.x * d;
    float2 s = row_statistics(row, d, eps, shared);
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        out[i] = store<T>((load(row[i]) - s.x) * s.y * w[i] + b[i]);
    }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, per row; one
// block a row, which also writes the row's mean and rstd into `stats` for
// the parameters' gradients.
template <typename T>
__device__ void layer_norm_backward_input(const T* x, const float* w, const T* dy, T* dx, float2* stats, unsigned int d, float eps) {
    extern __shared__ float shared[];
    unsigned long long at = (unsigned long long)blockIdx.x * d;
    float2 s = row_statistics(x + at, d, eps, shared);
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        float g = load(dy[at + i]) * w[i];
        sum_g += g;
        sum_gx += g * (load(x[at + i]) - s.x) * s.y;
    }
    float mean_g = block_sum(sum_g, shared) / d;
    float mean_gx = block_sum(sum_gx, shared) / d;
    for (unsigned int i = threadIdx.x; i < d; i += blockDim.x) {
        float xhat = (load(x[at + i]) - s.x) * s.y;
        float g = load(dy[at + i]) * w[i];
        dx[at + i] = store<T>(s.y * (g - mean_g - xhat * mean_gx));
    }
    if (threadIdx.x == 0) stats[blockIdx.x] = s;
}

// dw = sum over rows of dy xhat, db = sum of dy; one thread a feature.
template <typename T>
__device__ void layer_norm_backward_params(const T* x, const T* dy, const float2* stats, float* dw, float* db, unsigned int rows, unsigned int d) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    float sum_w = 0.0f, sum_b = 0.0f;
    for (unsigned int r = 0; r < rows; r++) {
        unsigned long long at = (unsigned long long)r * d + i;
        float g = load(dy[at]);
        sum_w += g * (load(x[at]) - stats[r].x) * stats[r].y;
        sum_b += g;
    }
    dw[i] = sum_w;
    db[i] = sum_b;
}

#define KERNELS(T, NAME)                                                                                                  \
    extern "C" __global__ void gelu_##NAME(const T* x, T* y, unsigned long long n) { gelu(x, y, n); }                    \
    extern "C" __global__ void gelu_backward_##NAME(const T* x, const T* dy, T* dx, unsigned long long n) {             \
        gelu_backward(x, dy, dx, n);                                                                                     \
    }                                                                                                                    \
    extern "C" __global__ void layer_norm_##NAME(const T* x, const float* w, const float* b, T* y, unsigned int d,      \
                                                 float eps) {                                                            \
        layer_norm(x, w, b, y, d, eps);                                                                                  \
    }                                                                                                                    \
    extern "C" __global__ void layer_norm_backward_input_##NAME(const T* x, const float* w, const T* dy, T* dx,         \
                                                                float2* stats, unsigned int d, float eps) {             \
        layer_norm_backward_input(x, w, dy, dx, stats, d, eps);                                                          \
    }                                                                                                                    \
    extern "C" __global__ void layer_norm_backward_params_##NAME(const T* x, const T* dy, const float2* stats,          \
                                                                 float* dw, float* db, unsigned int rows,               \
                                                                 unsigned int d) {                                      \
        layer_norm_backward_params(x, dy, stats, dw, db, rows, d);                                                       \
    }

KERNELS(float, f32)
KERNELS(__half, f16)
KERNELS(__nv_bfloat16, bf16)

// Attention's row passes, one batch element's heads at a time: rows of n
// scores (f32, from cuBLAS), probabilities in the maps' type.

// The largest of every thread's `v` in a block of a power-of-two size, on all threads.
__device__ float block_max(float v, float* shared) {
    shared[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) shared[threadIdx.x] = fmaxf(shared[threadIdx.x], shared[threadIdx.x + half]);
        __syncthreads();
    }
    float most = shared[0];
    __syncthreads();
    return most;
}

// p = e^(scale s - lse) with lse = log sum_j e^(scale s_j), the row's
// log-sum-exp written to lse[row]; one block a row of n.
template <typename T> __device__ void softmax_rows(const float* s, T* p, float* lse, unsigned int n, float scale) {
    extern __shared__ float shared[];
    const float* row = s + (unsigned long long)blockIdx.x * n;
    T* out = p + (unsigned long long)blockIdx.x * n;
    float most = -INFINITY;
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) most = fmaxf(most, row[j]);
    float shift = scale * block_max(most, shared);
    float sum = 0.0f;
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) sum += expf(scale * row[j] - shift);
    float l = shift + logf(block_sum(sum, shared));
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) out[j] = store<T>(expf(scale * row[j] - l));
    if (threadIdx.x == 0) lse[blockIdx.x] = l;
}

// p = e^(scale s - lse[row]) over rows of n, from a kept log-sum-exp.
template <typename T> __device__ void probabilities(const float* s, const float* lse, T* p, unsigned int n, float scale,
                                                    unsigned long long total) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        p[i] = store<T>(expf(scale * s[i] - lse[i / n]));
    }
}

// delta[h tokens + i] = sum_c dout[i, h dh + c] out[i, h dh + c] over one
// batch element's rows of d = heads dh; one thread a row of a head.
template <typename T> __device__ void attention_delta(const T* dout, const T* out, float* delta, unsigned int tokens,
                                                      unsigned int heads, unsigned int dh) {
    unsigned int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= heads * tokens) return;
    unsigned int h = r / tokens, i = r % tokens;
    unsigned long long at = (unsigned long long)i * heads * dh + h * dh;
    float sum = 0.0f;
    for (unsigned int c = 0; c < dh; c++) sum += load(dout[at + c]) * load(out[at + c]);
    delta[r] = sum;
}

// ds = p (dp - delta[row]) scale over rows of n: the scores' gradient before scaling.
template <typename T> __device__ void softmax_backward(const T* p, const float* dp, const float* delta, T* ds, unsigned int n,
                                                       float scale, unsigned long long total) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)blockDim.x * gridDim.x) {
        ds[i] = store<T>(load(p[i]) * (dp[i] - delta[i / n]) * scale);
    }
}

#define ATTENTION_KERNELS(T, NAME)                                                                                      \
    extern "C" __global__ void softmax_rows_##NAME(const float* s, T* p, float* lse, unsigned int n, float scale) {    \
        softmax_rows(s, p, lse, n, scale);                                                                             \
    }                                                                                                                  \
    extern "C" __global__ void probabilities_##NAME(const float* s, const float* lse, T* p, unsigned int n, float scale, \
                                                    unsigned long long total) {                                        \
        probabilities(s, lse, p, n, scale, total);                                                                     \
    }                                                                                                                  \
    extern "C" __global__ void attention_delta_##NAME(const T* dout, const T* out, float* delta, unsigned int tokens,  \
                                                      unsigned int heads, unsigned int dh) {                           \
        attention_delta(dout, out, delta, tokens, heads, dh);                                                          \
    }                                                                                                                  \
    extern "C" __global__ void softmax_backward_##NAME(const T* p, const float* dp, const float* delta, T* ds,         \
                                                       unsigned int n, float scale, unsigned long long total) {        \
        softmax_backward(p, dp, delta, ds, n, scale, total);                                                           \
    }

ATTENTION_KERNELS(float, f32)
ATTENTION_KERNELS(__half, f16)
ATTENTION_KERNELS(__nv_bfloat16, bf16)
