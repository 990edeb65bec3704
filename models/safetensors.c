/* safetensors reading and writing. The reader trusts nothing in a file: every length, offset and
 * shape is checked before use, so a malformed file gives a message naming the file and the tensor,
 * never a crash. Data moves through a few MiB of scratch, never a whole tensor's second copy. */
#include "models/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/dtype.h"
#include "models/report.h"

#define CHUNK_BYTES ((size_t)4 << 20)

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

static const struct { const char *name; size_t size; } dtypes[] = {
    [MT_ST_F32] = { "F32", 4 },   [MT_ST_F16] = { "F16", 2 },   [MT_ST_BF16] = { "BF16", 2 },
    [MT_ST_F64] = { "F64", 8 },   [MT_ST_I64] = { "I64", 8 },   [MT_ST_I32] = { "I32", 4 },
    [MT_ST_I16] = { "I16", 2 },   [MT_ST_I8] = { "I8", 1 },     [MT_ST_U8] = { "U8", 1 },
    [MT_ST_BOOL] = { "BOOL", 1 }, [MT_ST_F8_E4M3] = { "F8_E4M3", 1 },
    [MT_ST_F8_E5M2] = { "F8_E5M2", 1 }, [MT_ST_U16] = { "U16", 2 }, [MT_ST_U32] = { "U32", 4 },
    [MT_ST_U64] = { "U64", 8 },
};
#define NDTYPES ((int)(sizeof dtypes / sizeof dtypes[0]))

const char *mt_st_dtype_name(mt_st_dtype t) { return (int)t >= 0 && (int)t < NDTYPES ? dtypes[t].name : NULL; }
size_t mt_st_dtype_size(mt_st_dtype t) { return (int)t >= 0 && (int)t < NDTYPES ? dtypes[t].size : 0; }

/* Reads exactly len bytes at off; a short read means the file shrank or lies about its size. */
static int pread_all(int fd, void *buf, size_t len, uint64_t off, const char *path, const char *what,
                     char *err, size_t errlen)
{
    char *p = buf;
    while (len > 0) {
        ssize_t r = pread(fd, p, len, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return mt_fail(err, errlen, "%s: %s: read error: %s", path, what, strerror(errno));
        if (r == 0) return mt_fail(err, errlen, "%s: %s: unexpected end of file at byte %llu", path, what,
                                (unsigned long long)off);
        p += r;
        len -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int write_all(int fd, const void *buf, size_t len, const char *path, char *err, size_t errlen)
{
    const char *p = buf;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return mt_fail(err, errlen, "%s: write error: %s", path, strerror(errno));
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

static int parse_dtype(const char *s, mt_st_dtype *out)
{
    for (int i = 0; i < NDTYPES; i++)
        if (!strcmp(s, dtypes[i].name)) { *out = (mt_st_dtype)i; return 0; }
    return -1;
}

/* Fills t from one header entry; path and name are for messages. */
static int parse_entry(const char *path, const char *name, json_t *v, uint64_t data_size, mt_st_tensor *t,
                       char *err, size_t errlen)
{
    if (!json_is_object(v)) return mt_fail(err, errlen, "%s: tensor '%s': header entry is not an object", path, name);
    json_t *jd = json_object_get(v, "dtype"), *js = json_object_get(v, "shape"), *jo = json_object_get(v, "data_offsets");
    if (!json_is_string(jd)) return mt_fail(err, errlen, "%s: tensor '%s': missing or non-string 'dtype'", path, name);
    if (parse_dtype(json_string_value(jd), &t->dtype))
        return mt_fail(err, errlen, "%s: tensor '%s': unknown dtype '%s'", path, name, json_string_value(jd));
    if (!json_is_array(js)) return mt_fail(err, errlen, "%s: tensor '%s': missing or non-array 'shape'", path, name);
    if (json_array_size(js) > MT_ST_MAX_DIMS)
        return mt_fail(err, errlen, "%s: tensor '%s': %zu dimensions (at most %d)", path, name, json_array_size(js), MT_ST_MAX_DIMS);
    t->ndim = (int)json_array_size(js);
    /* Element count bounded by the data size, so products cannot overflow. */
    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        json_t *e = json_array_get(js, (size_t)i);
        if (!json_is_integer(e) || json_integer_value(e) < 0)
            return mt_fail(err, errlen, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, i);
        t->shape[i] = json_integer_value(e);
        if (t->shape[i] != 0 && numel > (data_size + 1) / (uint64_t)t->shape[i])
            numel = data_size + 1; /* already too large for the file: the size check below reports it */
        else
            numel *= (uint64_t)t->shape[i];
    }
    t->numel = (int64_t)numel;
    if (!json_is_array(jo) || json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0))
        || !json_is_integer(json_array_get(jo, 1)))
        return mt_fail(err, errlen, "%s: tensor '%s': 'data_offsets' is not a pair of integers", path, name);
    json_int_t b = json_integer_value(json_array_get(jo, 0)), e = json_integer_value(json_array_get(jo, 1));
    if (b < 0 || e < b)
        return mt_fail(err, errlen, "%s: tensor '%s': data_offsets [%lld, %lld] are not an ascending non-negative pair",
                    path, name, (long long)b, (long long)e);
    t->begin = (uint64_t)b;
    t->end = (uint64_t)e;
    if (t->end > data_size)
        return mt_fail(err, errlen, "%s: tensor '%s': data_offsets [%llu, %llu] out of range: the data buffer has %llu bytes"
                    " (truncated file?)", path, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                    (unsigned long long)data_size);
    uint64_t want = numel > data_size ? data_size + 1 : numel * dtypes[t->dtype].size;
    if (t->end - t->begin != want)
        return mt_fail(err, errlen, "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, dtype %s and shape need %s%llu",
                    path, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                    (unsigned long long)(t->end - t->begin), dtypes[t->dtype].name,
                    numel > data_size ? "more than " : "", (unsigned long long)(numel > data_size ? data_size : want));
    return 0;
}

static int by_begin(const void *a, const void *b)
{
    const mt_st_tensor *x = *(const mt_st_tensor *const *)a, *y = *(const mt_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Overlaps and holes: the ranges sorted by start must tile [0, data_size) exactly. */
static int check_coverage(const mt_st_file *f, uint64_t data_size, char *err, size_t errlen)
{
    if (f->ntensors == 0) {
        if (data_size != 0)
            return mt_fail(err, errlen, "%s: no tensors, but %llu bytes of data after the header", f->path,
                        (unsigned long long)data_size);
        return 0;
    }
    const mt_st_tensor **order = malloc(sizeof *order * (size_t)f->ntensors);
    if (!order) return mt_fail(err, errlen, "%s: out of memory", f->path);
    for (int i = 0; i < f->ntensors; i++) order[i] = &f->tensors[i];
    qsort(order, (size_t)f->ntensors, sizeof *order, by_begin);
    int rc = 0;
    /* Overlaps first: a range moved onto another also leaves a hole, and the overlap is the
     * better diagnosis. */
    for (int i = 1; i < f->ntensors && rc == 0; i++) {
        const mt_st_tensor *t = order[i], *prev = order[i - 1];
        if (t->begin < prev->end)
            rc = mt_fail(err, errlen, "%s: tensor '%s': data_offsets [%llu, %llu] overlap tensor '%s' [%llu, %llu]",
                      f->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end, prev->name,
                      (unsigned long long)prev->begin, (unsigned long long)prev->end);
    }
    uint64_t at = 0;
    const mt_st_tensor *prev = NULL;
    for (int i = 0; i < f->ntensors && rc == 0; i++) {
        const mt_st_tensor *t = order[i];
        if (t->begin > at)
            rc = mt_fail(err, errlen, "%s: tensor '%s': data_offsets [%llu, %llu] leave the bytes [%llu, %llu) unindexed",
                      f->path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                      (unsigned long long)at, (unsigned long long)t->begin);
        at = t->end;
        prev = t;
    }
    if (rc == 0 && at != data_size)
        rc = mt_fail(err, errlen, "%s: %llu bytes after the last tensor's data ('%s' ends at %llu of %llu)", f->path,
                  (unsigned long long)(data_size - at), prev->name, (unsigned long long)at,
                  (unsigned long long)data_size);
    free(order);
    return rc;
}

/* Parses the header text into f->tensors. */
static int parse_header(mt_st_file *f, const char *text, size_t len, char *err, size_t errlen)
{
    if (len == 0 || text[0] != '{')
        return mt_fail(err, errlen, "%s: header does not start with '{' (not a safetensors file, or a wrong header length %zu)",
                    f->path, len);
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return mt_fail(err, errlen, "%s: header is not valid JSON (header length %zu; byte %d: %s)", f->path, len,
                    je.position, je.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return mt_fail(err, errlen, "%s: header is not a JSON object", f->path);
    }
    uint64_t data_size = f->file_size - f->data_start;
    f->tensors = calloc(json_object_size(root) + 1, sizeof *f->tensors);
    if (!f->tensors) {
        json_decref(root);
        return mt_fail(err, errlen, "%s: out of memory", f->path);
    }
    const char *name;
    json_t *v;
    int rc = 0;
    json_object_foreach(root, name, v) {
        if (!strcmp(name, "__metadata__")) {
            if (!json_is_object(v)) { rc = mt_fail(err, errlen, "%s: '__metadata__' is not an object", f->path); break; }
            continue;
        }
        mt_st_tensor *t = &f->tensors[f->ntensors];
        if (parse_entry(f->path, name, v, data_size, t, err, errlen)) { rc = -1; break; }
        t->name = strdup(name);
        f->ntensors++;
    }
    json_decref(root);
    if (rc == 0) rc = check_coverage(f, data_size, err, errlen);
    return rc;
}

mt_st_file *mt_st_open(const char *path, char *err, size_t errlen)
{
    mt_st_file *f = calloc(1, sizeof *f);
    if (!f) { mt_fail(err, errlen, "%s: out of memory", path); return NULL; }
    f->path = strdup(path);
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        mt_fail(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        mt_st_close(f);
        return NULL;
    }
    struct stat sb;
    char *header = NULL;
    unsigned char len8[8];
    if (fstat(f->fd, &sb) != 0) { mt_fail(err, errlen, "%s: cannot stat: %s", path, strerror(errno)); goto bad; }
    if (!S_ISREG(sb.st_mode)) { mt_fail(err, errlen, "%s: not a regular file", path); goto bad; }
    f->file_size = (uint64_t)sb.st_size;
    if (f->file_size < 8) {
        mt_fail(err, errlen, "%s: %llu bytes: too short for the 8-byte header length", path, (unsigned long long)f->file_size);
        goto bad;
    }
    if (pread_all(f->fd, len8, 8, 0, path, "header length", err, errlen)) goto bad;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len8[i];
    if (n > f->file_size - 8) {
        mt_fail(err, errlen, "%s: header length %llu exceeds the file (%llu bytes after the length field)", path,
             (unsigned long long)n, (unsigned long long)(f->file_size - 8));
        goto bad;
    }
    if (n > MT_ST_MAX_HEADER) {
        mt_fail(err, errlen, "%s: header length %llu exceeds the format's limit of %llu", path, (unsigned long long)n,
             (unsigned long long)MT_ST_MAX_HEADER);
        goto bad;
    }
    f->data_start = 8 + n;
    header = malloc(n + 1);
    if (!header) { mt_fail(err, errlen, "%s: out of memory for a %llu-byte header", path, (unsigned long long)n); goto bad; }
    if (pread_all(f->fd, header, n, 8, path, "header", err, errlen)) goto bad;
    header[n] = 0;
    if (parse_header(f, header, n, err, errlen)) goto bad;
    free(header);
    return f;
bad:
    free(header);
    mt_st_close(f);
    return NULL;
}

void mt_st_close(mt_st_file *f)
{
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    for (int i = 0; i < f->ntensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(f->scratch);
    free(f->path);
    free(f);
}

const mt_st_tensor *mt_st_find(const mt_st_file *f, const char *name)
{
    for (int i = 0; i < f->ntensors; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

/* IEEE half -> float, exact (every half is a float): subnormals normalised, inf and NaN kept. */
static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0 && mant == 0) {
        bits = sign;
    } else if (exp == 0) {
        int shift = 0;
        while (!(mant & 0x400u)) { mant <<= 1; shift++; }
        bits = sign | (uint32_t)(113 - shift) << 23 | (mant & 0x3FFu) << 13;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | mant << 13;
    } else {
        bits = sign | (exp + 112) << 23 | mant << 13;
    }
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

int mt_st_read_f32(mt_st_file *f, const mt_st_tensor *t, float *dst, char *err, size_t errlen)
{
    return mt_st_read_f32_range(f, t, 0, t->numel, dst, err, errlen);
}

int mt_st_read_f32_range(mt_st_file *f, const mt_st_tensor *t, int64_t first, int64_t count, float *dst, char *err,
                         size_t errlen)
{
    if (t->dtype != MT_ST_F32 && t->dtype != MT_ST_F16 && t->dtype != MT_ST_BF16)
        return mt_fail(err, errlen, "%s: tensor '%s': dtype %s cannot be read as floating point weights (want F32, F16 or BF16)",
                    f->path, t->name, dtypes[t->dtype].name);
    if (first < 0 || count < 0 || first > t->numel || count > t->numel - first)
        return mt_fail(err, errlen, "%s: tensor '%s': elements [%lld, %lld) outside its %lld", f->path, t->name,
                       (long long)first, (long long)(first + count), (long long)t->numel);
    char what[300];
    snprintf(what, sizeof what, "tensor '%s'", t->name);
    const size_t esize = dtypes[t->dtype].size;
    uint64_t off = f->data_start + t->begin + (uint64_t)first * esize;
    if (t->dtype == MT_ST_F32) /* straight into the destination */
        return pread_all(f->fd, dst, (size_t)count * esize, off, f->path, what, err, errlen);
    if (!f->scratch && !(f->scratch = malloc(CHUNK_BYTES))) return mt_fail(err, errlen, "%s: out of memory", f->path);
    const uint16_t *half = f->scratch;
    int64_t per_chunk = (int64_t)(CHUNK_BYTES / 2);
    for (int64_t done = 0; done < count; done += per_chunk) {
        int64_t n = count - done < per_chunk ? count - done : per_chunk;
        if (pread_all(f->fd, f->scratch, (size_t)n * 2, off + (uint64_t)done * 2, f->path, what, err, errlen)) return -1;
        float *out = dst + done;
        if (t->dtype == MT_ST_BF16) mt_bf16_to_f32(n, half, out);
        else for (int64_t i = 0; i < n; i++) out[i] = f16_to_f32(half[i]);
    }
    return 0;
}

int mt_st_read_bytes(mt_st_file *f, const mt_st_tensor *t, uint64_t first, uint64_t count, void *dst, char *err,
                     size_t errlen)
{
    const uint64_t size = t->end - t->begin;
    if (first > size || count > size - first)
        return mt_fail(err, errlen, "%s: tensor '%s': bytes [%llu, %llu) outside its %llu", f->path, t->name,
                       (unsigned long long)first, (unsigned long long)(first + count), (unsigned long long)size);
    char what[300];
    snprintf(what, sizeof what, "tensor '%s'", t->name);
    return pread_all(f->fd, dst, (size_t)count, f->data_start + t->begin + first, f->path, what, err, errlen);
}

static int64_t source_numel(const mt_st_source *s)
{
    int64_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= s->shape[i];
    return n;
}

/* The header JSON, padded with spaces so that 8 + its length is a multiple of 8. */
static char *build_header(const mt_st_source *ts, int n, mt_st_dtype dtype, size_t *len)
{
    json_t *root = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(root, "__metadata__", meta);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        json_t *e = json_object(), *shape = json_array(), *offs = json_array();
        for (int d = 0; d < ts[i].ndim; d++) json_array_append_new(shape, json_integer(ts[i].shape[d]));
        uint64_t bytes = mt_st_nbytes(dtype, source_numel(&ts[i]));
        json_array_append_new(offs, json_integer((json_int_t)at));
        json_array_append_new(offs, json_integer((json_int_t)(at + bytes)));
        at += bytes;
        json_object_set_new(e, "dtype", json_string(dtypes[dtype].name));
        json_object_set_new(e, "shape", shape);
        json_object_set_new(e, "data_offsets", offs);
        json_object_set_new(root, ts[i].name, e);
    }
    char *text = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (!text) return NULL;
    size_t raw = strlen(text), padded = (raw + 7) / 8 * 8;
    char *out = realloc(text, padded + 1);
    if (!out) { free(text); return NULL; }
    memset(out + raw, ' ', padded - raw);
    out[padded] = 0;
    *len = padded;
    return out;
}

int mt_st_write(const char *path, const mt_st_source *ts, int n, mt_st_dtype dtype, char *err, size_t errlen)
{
    if (dtype != MT_ST_F32 && dtype != MT_ST_BF16)
        return mt_fail(err, errlen, "%s: cannot write dtype %s (F32 or BF16)", path, mt_st_dtype_name(dtype) ? mt_st_dtype_name(dtype) : "?");
    for (int i = 0; i < n; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(ts[i].name, ts[j].name))
                return mt_fail(err, errlen, "%s: tensor '%s': given twice", path, ts[i].name);
    size_t hlen = 0;
    char *header = build_header(ts, n, dtype, &hlen);
    if (!header) return mt_fail(err, errlen, "%s: cannot build the header (out of memory)", path);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        free(header);
        return mt_fail(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    int rc = write_all(fd, len8, 8, tmp, err, errlen);
    if (rc == 0) rc = write_all(fd, header, hlen, tmp, err, errlen);
    free(header);
    mt_bf16 *scratch = NULL;
    float *produced = NULL; /* a chunk of a source that has read instead of data */
    bool any_read = false;
    for (int i = 0; i < n; i++) any_read |= ts[i].data == NULL;
    if (rc == 0 && dtype == MT_ST_BF16 && !(scratch = malloc(CHUNK_BYTES))) rc = mt_fail(err, errlen, "%s: out of memory", path);
    if (rc == 0 && any_read && !(produced = malloc(CHUNK_BYTES))) rc = mt_fail(err, errlen, "%s: out of memory", path);
    for (int i = 0; i < n && rc == 0; i++) {
        int64_t numel = source_numel(&ts[i]);
        if (dtype == MT_ST_F32 && ts[i].data) {
            rc = write_all(fd, ts[i].data, (size_t)numel * sizeof(float), tmp, err, errlen);
            continue;
        }
        /* a chunk of fp32 elements (CHUNK_BYTES) converts into half the scratch */
        int64_t per_chunk = (int64_t)(CHUNK_BYTES / sizeof(float));
        for (int64_t done = 0; done < numel && rc == 0; done += per_chunk) {
            int64_t m = numel - done < per_chunk ? numel - done : per_chunk;
            const float *src = ts[i].data ? ts[i].data + done : produced;
            if (!ts[i].data) ts[i].read(ts[i].ctx, done, m, produced);
            if (dtype == MT_ST_F32) {
                rc = write_all(fd, src, (size_t)m * sizeof(float), tmp, err, errlen);
                continue;
            }
            mt_f32_to_bf16(m, src, scratch);
            rc = write_all(fd, scratch, (size_t)m * sizeof *scratch, tmp, err, errlen);
        }
    }
    free(produced);
    free(scratch);
    if (rc == 0 && fsync(fd) != 0) rc = mt_fail(err, errlen, "%s: fsync: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0) rc = mt_fail(err, errlen, "%s: close: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) != 0) rc = mt_fail(err, errlen, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
    if (rc != 0) unlink(tmp);
    return rc;
}
