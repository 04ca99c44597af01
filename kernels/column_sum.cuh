// fusec column sums: the sum over the leading axes of a [rows, C] matrix,
// column by column (every bias gradient; a mean of a whole tensor is the sum
// of its one column), either of a stored tensor or of the values a chain of
// elementwise ops computes as it goes (dropout's backward or GELU's with its
// bias gradient, so the gradient is not read back from memory for its sum).
//
// Needs the prelude (fusec_prelude.cuh: fs_i64, fs_ldcg, fs_last_to_finish) before it, and
// nothing else: NVRTC compiles it without CUDA's headers.
//
// Work item w of the grid-stride loop is a tile of WIDTH = LANES * V columns
// and one of `splits` runs of the rows. A block's threads split into LANES
// lanes of V columns each by blockDim / LANES row slices; each thread adds
// every slices-th row of its run for its columns (`add_row(r, j, acc)` adds
// row r's V values from column j into acc[0..V)); the slices add up in slice
// order into the run's f32 partial in global memory (`part`, splits x C);
// the last run of a tile to finish (counted with an atomic in `done`, one a
// tile, zero before the first launch: the last run resets its tile's count,
// so a graph replay starts from zero) adds the tile's partials in run order
// and hands each column's total to `store(j, total)`. Coalesced (a warp's
// lanes read adjacent V-element vectors of one row) and deterministic (the
// partials are added in a fixed order; the atomic only counts).
//
// Blocks of at most 256 threads. A block narrower than LANES (the host
// emulation's one thread) takes the lanes in turns. UNROLL unrolls the row
// loop (0 leaves it to the compiler).
#ifndef FS_COLUMN_SUM
#define FS_COLUMN_SUM

// Fewest rows a run sums where the rows allow (the compiler's
// emit::multi::MIN_RUN_ROWS, which sizes `part`).
#define FS_MIN_RUN_ROWS 64

// Runs of rows a tile's sum takes: at most `most_splits` (the partials'
// room), each of at least FS_MIN_RUN_ROWS rows where there are that many.
__device__ __forceinline__ fs_i64 fs_column_sum_splits(fs_i64 rows, fs_i64 most_splits) {
    const fs_i64 fill = rows / FS_MIN_RUN_ROWS;
    return fill < 1 ? 1 : fill < most_splits ? fill : most_splits;
}

// Work item w (of tiles x fs_column_sum_splits(rows, most_splits)): one run
// of one tile, and the tile's total where it is the last run to finish. A
// kernel that runs several sums (a group kernel) hands each block's items
// to their sums; every thread of the block calls it with the same w.
template <int V, int LANES, int UNROLL, typename AddRow, typename Store>
__device__ __forceinline__ void fs_column_sum_item(const AddRow& add_row, const Store& store, fs_i64 rows, fs_i64 C,
                                                   fs_i64 most_splits, float* part_sums, unsigned* done, bool mean,
                                                   fs_i64 w) {
    constexpr int WIDTH = LANES * V;
    const fs_i64 splits = fs_column_sum_splits(rows, most_splits);
    const int step = (int)blockDim.x < LANES ? (int)blockDim.x : LANES, slices = (int)blockDim.x / step;
    const int slice = threadIdx.x / step;
    __shared__ float part[256 * V];
    const fs_i64 tile = w / splits, run = w % splits;
    const fs_i64 r0 = run * rows / splits, r1 = (run + 1) * rows / splits;
    for (int lane = threadIdx.x % step; lane < LANES; lane += step) {
        const fs_i64 j = tile * WIDTH + lane * V;
        float acc[V];
        for (int q = 0; q < V; ++q) acc[q] = 0.0f;
        if (j < C) {
            if constexpr (UNROLL > 0) {
#pragma unroll UNROLL
                for (fs_i64 r = r0 + slice; r < r1; r += slices) add_row(r, j, acc);
            } else {
                for (fs_i64 r = r0 + slice; r < r1; r += slices) add_row(r, j, acc);
            }
        }
        for (int q = 0; q < V; ++q) part[(slice * LANES + lane) * V + q] = acc[q];
    }
    __syncthreads();
    if (slice == 0)
        for (int lane = threadIdx.x % step; lane < LANES; lane += step) {
            const fs_i64 j = tile * WIDTH + lane * V;
            for (int q = 0; q < V && j < C; ++q) {
                float total = 0.0f;
                for (int s = 0; s < slices; ++s) total += part[(s * LANES + lane) * V + q];
                part_sums[run * C + j + q] = total;
            }
        }
    if (fs_last_to_finish(&done[tile], (unsigned)splits)) {
        for (fs_i64 j = tile * WIDTH + threadIdx.x; j < tile * WIDTH + WIDTH && j < C; j += blockDim.x) {
            float total = 0.0f;
            // In run order (deterministic), the loads through L2 but not
            // volatile, so they may be issued ahead of the adds.
#pragma unroll 8
            for (fs_i64 s = 0; s < splits; ++s) total += fs_ldcg(&part_sums[s * C + j]);
            store(j, mean ? total / (float)rows : total);
        }
        if (threadIdx.x == 0) done[tile] = 0;
    }
    __syncthreads();  // `part` is reused by the next item
}

template <int V, int LANES, int UNROLL, typename AddRow, typename Store>
__device__ __forceinline__ void fs_column_sums(const AddRow& add_row, const Store& store, fs_i64 rows, fs_i64 C,
                                               fs_i64 tiles, fs_i64 most_splits, float* part_sums, unsigned* done,
                                               bool mean) {
    const fs_i64 items = tiles * fs_column_sum_splits(rows, most_splits);
    for (fs_i64 w = blockIdx.x; w < items; w += gridDim.x)
        fs_column_sum_item<V, LANES, UNROLL>(add_row, store, rows, C, most_splits, part_sums, done, mean, w);
}

#endif
