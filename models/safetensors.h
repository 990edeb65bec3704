/* The safetensors file format: an 8-byte little-endian header length N, N bytes of JSON
 * ({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}), then the data
 * buffer. A validating reader that streams tensors into caller buffers, and a streaming writer. */
#ifndef MT_MODELS_SAFETENSORS_H
#define MT_MODELS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#define MT_ST_MAX_DIMS 8
#define MT_ST_MAX_HEADER ((uint64_t)100 << 20) /* the reference implementation's limit */

/* Element types a file may declare. Every one is validated for size; only F32, F16 and BF16
 * can be read as fp32, and only F32 and BF16 are written. */
typedef enum mt_st_dtype {
    MT_ST_F32, MT_ST_F16, MT_ST_BF16,
    MT_ST_F64, MT_ST_I64, MT_ST_I32, MT_ST_I16, MT_ST_I8, MT_ST_U8, MT_ST_BOOL,
    MT_ST_F8_E4M3, MT_ST_F8_E5M2, MT_ST_U16, MT_ST_U32, MT_ST_U64,
} mt_st_dtype;

typedef struct mt_st_tensor {
    char *name;
    mt_st_dtype dtype;
    int ndim;                          /* 0 (scalar) .. MT_ST_MAX_DIMS */
    int64_t shape[MT_ST_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;               /* bytes, relative to the start of the data buffer */
} mt_st_tensor;

typedef struct mt_st_file {
    char *path;
    int fd;
    uint64_t file_size;
    uint64_t data_start;               /* 8 + N */
    int ntensors;
    mt_st_tensor *tensors;             /* in header order */
    void *scratch;                     /* conversion buffer of the reader, allocated on first use */
} mt_st_file;

/* "F32", "BF16", ...; NULL for an out-of-range value. */
const char *mt_st_dtype_name(mt_st_dtype t);
size_t mt_st_dtype_size(mt_st_dtype t);

/* Opens a file and validates its header: length within the file, valid JSON without duplicate
 * keys, known dtypes, shapes, every tensor's byte range inside the data buffer and of the size its
 * shape needs, no overlaps, no holes (the buffer is entirely indexed, as the format requires).
 * Keeps the descriptor open for reads. Returns NULL with err set ("PATH: tensor 'NAME': ..."). */
mt_st_file *mt_st_open(const char *path, char *err, size_t errlen);
void mt_st_close(mt_st_file *f);

/* The tensor of that name, or NULL. */
const mt_st_tensor *mt_st_find(const mt_st_file *f, const char *name);

/* Reads a tensor (F32, F16 or BF16 on disk) into dst as fp32, dst holding t->numel floats. Streams
 * through a few MiB of scratch, so nothing is held twice. Returns 0, or -1 with err set. */
int mt_st_read_f32(mt_st_file *f, const mt_st_tensor *t, float *dst, char *err, size_t errlen);
/* The same for elements [first, first + count) of the tensor (row-major order) only. */
int mt_st_read_f32_range(mt_st_file *f, const mt_st_tensor *t, int64_t first, int64_t count, float *dst, char *err,
                         size_t errlen);
/* Bytes [first, first + count) of the tensor's data as stored, whatever its dtype (the packed
 * MXFP4 blocks and scales of quantised experts). */
int mt_st_read_bytes(mt_st_file *f, const mt_st_tensor *t, uint64_t first, uint64_t count, void *dst, char *err,
                     size_t errlen);

/* One tensor to write, from an fp32 source of numel = product of shape elements. */
typedef struct mt_st_source {
    const char *name;
    int ndim;
    int64_t shape[MT_ST_MAX_DIMS];
    const float *data;  /* the fp32 elements; or NULL and read: */
    /* Produces elements [first, first + n) into dst, chunk by chunk as the writer goes, for data
     * that is not held as fp32 (a compact master's two planes): the writer then never holds more
     * than a chunk of it. */
    void (*read)(const void *ctx, int64_t first, int64_t n, float *dst);
    const void *ctx;
} mt_st_source;

/* Writes the tensors in the given order as `dtype` (MT_ST_F32 or MT_ST_BF16, converted with
 * round to nearest even), with metadata {"format": "pt"} (transformers requires it). The header
 * is padded with spaces so the data buffer starts 8-byte aligned. Writes PATH.tmp.PID, fsyncs,
 * renames over PATH: a crash leaves the old file or the new one, never a torn one.
 * Returns 0, or -1 with err set. */
int mt_st_write(const char *path, const mt_st_source *tensors, int ntensors, mt_st_dtype dtype,
                char *err, size_t errlen);

/* Bytes a tensor of that element count takes in `dtype`. */
static inline uint64_t mt_st_nbytes(mt_st_dtype dtype, int64_t numel)
{
    return (uint64_t)numel * mt_st_dtype_size(dtype);
}

#endif
