// fusec gradient clipping and fp16 loss scaling: the scalars the update
// reads, from the sum of the squared gradients the global-norm kernel
// adds up. One thread does it (a kernel of one element).
//
// Needs the prelude (fusec_prelude.cuh) before it (fs_isfinite).
#ifndef FS_CLIP
#define FS_CLIP

// The clip coefficient of gradients whose 2-norm is `norm`:
// min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_
// (the 1e-6 keeps a zero norm finite).
__device__ __forceinline__ float fs_clip_coef(float norm, float max_norm) {
    return fminf(1.0f, max_norm / (norm + 1e-6f));
}

// What an fp16 step's update reads: the factor every scaled gradient is
// multiplied by (the clip coefficient of the true norm, over the scale),
// whether the step applies (0 once the scaled gradients overflowed, so
// the runtime skips it and lowers the scale), and the true norm.
struct FsUnscaled {
    float coef, apply, norm;
};

// `sumsq`: the squares of the scaled gradients, summed; `scale`: the loss
// scale; `apply`: the step's own flag (0 on a micro-batch that only
// accumulates); `max_norm` < 0: no clipping.
__device__ __forceinline__ FsUnscaled fs_unscale(float sumsq, float scale, float apply,
                                                 float max_norm) {
    const float norm = sqrtf(sumsq) / scale;
    const bool finite = fs_isfinite(sumsq);
    const float clip = (finite && max_norm >= 0.0f) ? fs_clip_coef(norm, max_norm) : 1.0f;
    return FsUnscaled{clip / scale, finite ? apply : 0.0f, norm};
}

#endif
