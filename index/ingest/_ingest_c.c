/* vLLM KV event ingest, its two hot loops in C (index/ingest/vllm_wire.py, vllm_blocks.py).

1. ``decode_batch``: a batch's BlockStored events. Decoding with msgspec makes one Python int
   per token (0.5-0.8 us a 16-token block, more than the whole block mapping costs), and the
   mapper then packs those ints back into u32 little-endian bytes to hash them. This reads a
   BlockStored's token ids straight into those bytes (``token_data``): one Python object per
   event instead of one per token.

   Only the common shape takes this path: a map whose keys are BlockStored's fields, with
   ints or bytes for hashes, unsigned 32-bit token ids, no extra keys. Anything else (another
   event type, extra keys, an unknown or repeated field, a token id out of range, a
   malformed value) is handed back as the event's raw bytes, which vllm_wire.py decodes with
   msgspec, so every event decodes exactly as msgspec alone would decode it or fails as it
   would. A batch whose outer array cannot be read returns None (msgspec then raises the
   precise error).

   Untrusted input: every read is bounds-checked against the payload's end, nesting is
   capped (SKIP_DEPTH) and lengths are checked before they are used; nothing here allocates
   from a length it has not checked against the bytes present.

2. ``new_records``: the block records of a chunk a prefill step stored whole
   (``BlockMapper._new_chunk``), built and inserted into the mapper's dict without a Python
   loop: what the Python fallback there does, record for record.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SKIP_DEPTH 64

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static int need(Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* A container header: 0 ok (*len set), -1 not that kind or truncated. */
static int read_array(Reader *r, uint32_t *len) {
    if (!need(r, 1)) return -1;
    uint8_t b = *r->p;
    if ((b & 0xf0) == 0x90) { *len = b & 0x0f; r->p += 1; return 0; }
    if (b == 0xdc && need(r, 3)) { *len = (uint32_t)be(r->p + 1, 2); r->p += 3; return 0; }
    if (b == 0xdd && need(r, 5)) { *len = (uint32_t)be(r->p + 1, 4); r->p += 5; return 0; }
    return -1;
}

static int read_map(Reader *r, uint32_t *len) {
    if (!need(r, 1)) return -1;
    uint8_t b = *r->p;
    if ((b & 0xf0) == 0x80) { *len = b & 0x0f; r->p += 1; return 0; }
    if (b == 0xde && need(r, 3)) { *len = (uint32_t)be(r->p + 1, 2); r->p += 3; return 0; }
    if (b == 0xdf && need(r, 5)) { *len = (uint32_t)be(r->p + 1, 4); r->p += 5; return 0; }
    return -1;
}

/* A str: 0 ok (*s, *n set, bytes present), -1 otherwise. */
static int read_str(Reader *r, const char **s, uint32_t *n) {
    if (!need(r, 1)) return -1;
    uint8_t b = *r->p;
    size_t head;
    if ((b & 0xe0) == 0xa0) { *n = b & 0x1f; head = 1; }
    else if (b == 0xd9 && need(r, 2)) { *n = r->p[1]; head = 2; }
    else if (b == 0xda && need(r, 3)) { *n = (uint32_t)be(r->p + 1, 2); head = 3; }
    else if (b == 0xdb && need(r, 5)) { *n = (uint32_t)be(r->p + 1, 4); head = 5; }
    else return -1;
    if (!need(r, head + *n)) return -1;
    *s = (const char *)r->p + head;
    r->p += head + *n;
    return 0;
}

/* An integer: 0 ok (*neg says whether *v is an int64 below zero), -1 otherwise. */
static int read_int(Reader *r, uint64_t *v, int *neg) {
    if (!need(r, 1)) return -1;
    uint8_t b = *r->p;
    *neg = 0;
    if (b <= 0x7f) { *v = b; r->p += 1; return 0; }
    if (b >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)b; *neg = 1; r->p += 1; return 0; }
    int n;
    int is_signed;
    switch (b) {
        case 0xcc: n = 1; is_signed = 0; break;
        case 0xcd: n = 2; is_signed = 0; break;
        case 0xce: n = 4; is_signed = 0; break;
        case 0xcf: n = 8; is_signed = 0; break;
        case 0xd0: n = 1; is_signed = 1; break;
        case 0xd1: n = 2; is_signed = 1; break;
        case 0xd2: n = 4; is_signed = 1; break;
        case 0xd3: n = 8; is_signed = 1; break;
        default: return -1;
    }
    if (!need(r, 1 + (size_t)n)) return -1;
    uint64_t raw = be(r->p + 1, n);
    r->p += 1 + n;
    if (is_signed) {
        int64_t s;
        if (n == 1) s = (int8_t)raw;
        else if (n == 2) s = (int16_t)raw;
        else if (n == 4) s = (int32_t)raw;
        else s = (int64_t)raw;
        *v = (uint64_t)s;
        *neg = s < 0;
    } else {
        *v = raw;
    }
    return 0;
}

static int is_nil(Reader *r) {
    if (need(r, 1) && *r->p == 0xc0) { r->p += 1; return 1; }
    return 0;
}

/* Skip one object of any kind: 0 ok, -1 truncated, unknown or nested deeper than depth. */
static int skip(Reader *r, int depth) {
    if (depth <= 0 || !need(r, 1)) return -1;
    uint8_t b = *r->p;
    uint64_t n = 0;
    size_t head = 1;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) { r->p += 1; return 0; }
    if ((b & 0xe0) == 0xa0) { n = b & 0x1f; goto bytes; }
    if ((b & 0xf0) == 0x90) { n = b & 0x0f; r->p += 1; goto items; }
    if ((b & 0xf0) == 0x80) { n = (uint64_t)(b & 0x0f) * 2; r->p += 1; goto items; }
    switch (b) {
        case 0xcc: case 0xd0: return need(r, 2) ? (r->p += 2, 0) : -1;
        case 0xcd: case 0xd1: return need(r, 3) ? (r->p += 3, 0) : -1;
        case 0xce: case 0xd2: case 0xca: return need(r, 5) ? (r->p += 5, 0) : -1;
        case 0xcf: case 0xd3: case 0xcb: return need(r, 9) ? (r->p += 9, 0) : -1;
        case 0xd4: return need(r, 3) ? (r->p += 3, 0) : -1;   /* fixext 1 */
        case 0xd5: return need(r, 4) ? (r->p += 4, 0) : -1;
        case 0xd6: return need(r, 6) ? (r->p += 6, 0) : -1;
        case 0xd7: return need(r, 10) ? (r->p += 10, 0) : -1;
        case 0xd8: return need(r, 18) ? (r->p += 18, 0) : -1;
        case 0xc4: case 0xd9: if (!need(r, 2)) return -1; n = r->p[1]; head = 2; goto bytes;
        case 0xc5: case 0xda: if (!need(r, 3)) return -1; n = be(r->p + 1, 2); head = 3; goto bytes;
        case 0xc6: case 0xdb: if (!need(r, 5)) return -1; n = be(r->p + 1, 4); head = 5; goto bytes;
        case 0xc7: if (!need(r, 3)) return -1; n = r->p[1] + 1; head = 2; goto bytes;
        case 0xc8: if (!need(r, 4)) return -1; n = be(r->p + 1, 2) + 1; head = 3; goto bytes;
        case 0xc9: if (!need(r, 6)) return -1; n = be(r->p + 1, 4) + 1; head = 5; goto bytes;
        case 0xdc: if (!need(r, 3)) return -1; n = be(r->p + 1, 2); r->p += 3; goto items;
        case 0xdd: if (!need(r, 5)) return -1; n = be(r->p + 1, 4); r->p += 5; goto items;
        case 0xde: if (!need(r, 3)) return -1; n = be(r->p + 1, 2) * 2; r->p += 3; goto items;
        case 0xdf: if (!need(r, 5)) return -1; n = be(r->p + 1, 4) * 2; r->p += 5; goto items;
        default: return -1;
    }
bytes:
    if (!need(r, head + n)) return -1;
    r->p += head + n;
    return 0;
items:
    for (uint64_t i = 0; i < n; i++)
        if (skip(r, depth - 1) < 0) return -1;
    return 0;
}

/* A block hash: an int or bytes, as a new reference; NULL (no Python error) otherwise. */
static PyObject *read_hash(Reader *r) {
    if (!need(r, 1)) return NULL;
    uint8_t b = *r->p;
    if (b == 0xc4 || b == 0xc5 || b == 0xc6) {
        size_t head = b == 0xc4 ? 2 : b == 0xc5 ? 3 : 5;
        if (!need(r, head)) return NULL;
        uint64_t n = be(r->p + 1, (int)head - 1);
        if (!need(r, head + n)) return NULL;
        PyObject *out = PyBytes_FromStringAndSize((const char *)r->p + head, (Py_ssize_t)n);
        r->p += head + n;
        return out;
    }
    uint64_t v;
    int neg;
    if (read_int(r, &v, &neg) < 0) return NULL;
    return neg ? PyLong_FromLongLong((long long)(int64_t)v) : PyLong_FromUnsignedLongLong(v);
}

/* An optional int or str field value: a new reference (Py_None for nil), NULL otherwise. */
static PyObject *read_opt_int(Reader *r) {
    if (is_nil(r)) Py_RETURN_NONE;
    uint64_t v;
    int neg;
    if (read_int(r, &v, &neg) < 0) return NULL;
    return neg ? PyLong_FromLongLong((long long)(int64_t)v) : PyLong_FromUnsignedLongLong(v);
}

static PyObject *read_opt_str(Reader *r) {
    if (is_nil(r)) Py_RETURN_NONE;
    const char *s;
    uint32_t n;
    if (read_str(r, &s, &n) < 0) return NULL;
    PyObject *out = PyUnicode_DecodeUTF8(s, n, "strict");
    if (out == NULL) PyErr_Clear(); /* not UTF-8: msgspec decides what it is */
    return out;
}

/* BlockStored's fields on the wire (vllm_wire.BlockStored), in one table. */
enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP_IDX, F_SPEC_KIND, F_SLIDING_WINDOW, F_LOCALITY, F_OWNERSHIP,
    F_SESSION_ID, F_COUNT
};
static const char *FIELD_NAMES[F_COUNT] = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
};
/* msgspec requires these (no default in the struct) */
static const unsigned REQUIRED = (1u << F_TYPE) | (1u << F_HASHES) | (1u << F_PARENT) |
                                 (1u << F_TOKENS) | (1u << F_BLOCK_SIZE) | (1u << F_LORA_ID) |
                                 (1u << F_MEDIUM) | (1u << F_LORA_NAME);
static PyObject *FIELD_STRS[F_COUNT]; /* interned keyword names */
static PyObject *TOKEN_DATA;          /* "token_data" */

static int field_of(const char *s, uint32_t n) {
    for (int f = 0; f < F_COUNT; f++)
        if (strlen(FIELD_NAMES[f]) == n && memcmp(FIELD_NAMES[f], s, n) == 0) return f;
    return -1;
}

/* The token ids as u32 little-endian bytes (new reference), NULL if any is not a u32. */
static PyObject *read_tokens(Reader *r) {
    uint32_t n;
    if (read_array(r, &n) < 0 || !need(r, n)) return NULL; /* each token is >= 1 byte */
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 4);
    if (out == NULL) { PyErr_Clear(); return NULL; }
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(out);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t v;
        int neg;
        if (read_int(r, &v, &neg) < 0 || neg || v > 0xffffffffu) { Py_DECREF(out); return NULL; }
        w[0] = (uint8_t)v; w[1] = (uint8_t)(v >> 8); w[2] = (uint8_t)(v >> 16); w[3] = (uint8_t)(v >> 24);
        w += 4;
    }
    return out;
}

/* One event: a BlockStored instance (new reference), or NULL with no Python error set when
   it is not the fast path's shape (the caller hands its raw bytes to msgspec). */
static PyObject *read_stored(Reader *r, PyObject *cls) {
    uint32_t pairs;
    if (read_map(r, &pairs) < 0) return NULL;
    PyObject *values[F_COUNT] = {0};
    unsigned seen = 0;
    PyObject *result = NULL;
    for (uint32_t i = 0; i < pairs; i++) {
        const char *s;
        uint32_t n;
        if (read_str(r, &s, &n) < 0) goto done;
        int f = field_of(s, n);
        if (f < 0 || (seen & (1u << f))) goto done; /* unknown or repeated: msgspec's call */
        seen |= 1u << f;
        switch (f) {
            case F_TYPE:
                if (read_str(r, &s, &n) < 0 || n != 11 || memcmp(s, "BlockStored", 11) != 0)
                    goto done;
                break;
            case F_HASHES: {
                uint32_t count;
                if (read_array(r, &count) < 0 || !need(r, count)) goto done;
                PyObject *list = PyList_New(count);
                if (list == NULL) { PyErr_Clear(); goto done; }
                values[f] = list;
                for (uint32_t k = 0; k < count; k++) {
                    PyObject *h = read_hash(r);
                    if (h == NULL) { PyErr_Clear(); goto done; }
                    PyList_SET_ITEM(list, k, h);
                }
                break;
            }
            case F_PARENT:
                if (is_nil(r)) { values[f] = Py_NewRef(Py_None); break; }
                if ((values[f] = read_hash(r)) == NULL) { PyErr_Clear(); goto done; }
                break;
            case F_TOKENS:
                if ((values[f] = read_tokens(r)) == NULL) goto done;
                break;
            case F_EXTRA_KEYS:
                if (!is_nil(r)) goto done; /* multimodal / LoRA keys: msgspec decodes them */
                values[f] = Py_NewRef(Py_None);
                break;
            case F_BLOCK_SIZE: {
                uint64_t v;
                int neg;
                if (read_int(r, &v, &neg) < 0) goto done;
                values[f] = neg ? PyLong_FromLongLong((long long)(int64_t)v)
                                : PyLong_FromUnsignedLongLong(v);
                if (values[f] == NULL) { PyErr_Clear(); goto done; }
                break;
            }
            case F_LORA_ID: case F_GROUP_IDX: case F_SLIDING_WINDOW:
                if ((values[f] = read_opt_int(r)) == NULL) { PyErr_Clear(); goto done; }
                break;
            default: /* the optional strings */
                if ((values[f] = read_opt_str(r)) == NULL) goto done;
                break;
        }
    }
    if ((seen & REQUIRED) != REQUIRED) goto done;
    PyObject *kwargs = PyDict_New();
    if (kwargs == NULL) { PyErr_Clear(); goto done; }
    int failed = 0;
    for (int f = F_HASHES; f < F_COUNT && !failed; f++) {
        if (values[f] == NULL) continue;
        if (f == F_TOKENS) {
            failed |= PyDict_SetItem(kwargs, TOKEN_DATA, values[f]) < 0;
            PyObject *empty = PyList_New(0);
            failed |= empty == NULL || PyDict_SetItem(kwargs, FIELD_STRS[f], empty) < 0;
            Py_XDECREF(empty);
        } else {
            failed |= PyDict_SetItem(kwargs, FIELD_STRS[f], values[f]) < 0;
        }
    }
    if (!failed) {
        PyObject *args = PyTuple_New(0);
        if (args != NULL) {
            result = PyObject_Call(cls, args, kwargs);
            Py_DECREF(args);
        }
    }
    Py_DECREF(kwargs);
    if (result == NULL) PyErr_Clear();
done:
    for (int f = 0; f < F_COUNT; f++) Py_XDECREF(values[f]);
    return result;
}

/* decode_batch(payload, stored_cls) -> (ts, events) | None

   ``events``: per event, a ``stored_cls`` instance (BlockStored with ``token_data`` set and
   ``token_ids`` empty) or the event's raw msgpack bytes, for msgspec. None: the batch's
   outer array is not readable here (msgspec reports why). */
static PyObject *decode_batch(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *cls;
    if (!PyArg_ParseTuple(args, "y*O", &buf, &cls)) return NULL;
    Reader r = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    PyObject *events = NULL;
    PyObject *out = NULL;
    uint32_t outer, count;
    double ts;
    if (read_array(&r, &outer) < 0 || outer < 2 || outer > 3 || !need(&r, 1)) goto fallback;
    if (*r.p == 0xcb && need(&r, 9)) {
        uint64_t bits = be(r.p + 1, 8);
        memcpy(&ts, &bits, sizeof ts);
        r.p += 9;
    } else if (*r.p == 0xca && need(&r, 5)) {
        uint32_t bits = (uint32_t)be(r.p + 1, 4);
        float f;
        memcpy(&f, &bits, sizeof f);
        ts = f;
        r.p += 5;
    } else {
        goto fallback; /* an int timestamp or anything else: msgspec */
    }
    if (read_array(&r, &count) < 0 || !need(&r, count)) goto fallback;
    events = PyList_New(count);
    if (events == NULL) goto error;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *start = r.p;
        PyObject *ev = read_stored(&r, cls);
        if (ev == NULL) {
            r.p = start;
            if (skip(&r, SKIP_DEPTH) < 0) goto fallback;
            ev = PyBytes_FromStringAndSize((const char *)start, r.p - start);
            if (ev == NULL) goto error;
        }
        PyList_SET_ITEM(events, i, ev);
    }
    if (outer == 3) { /* data_parallel_rank: an int or nil, as RawBatch has it */
        uint64_t v;
        int neg;
        if (!is_nil(&r) && read_int(&r, &v, &neg) < 0) goto fallback;
    }
    if (r.p != r.end) goto fallback; /* trailing bytes: msgspec's error */
    out = Py_BuildValue("(dN)", ts, events);
    events = NULL;
    PyBuffer_Release(&buf);
    return out;
fallback:
    Py_XDECREF(events);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
error:
    Py_XDECREF(events);
    PyBuffer_Release(&buf);
    return NULL;
}

/* new_records(blocks, path, parents, start, block_size, window, body, one) -> last record

   For k in range(len(path)): blocks[path[k]] = [parents[k], start + k * block_size,
   start + (k + 1) * block_size, window, body, one, ()] (block_records.py's layout), in
   order, as vllm_blocks.py's Python loop does. */
static PyObject *new_records(PyObject *self, PyObject *args) {
    PyObject *blocks, *path, *parents, *win, *body, *one;
    Py_ssize_t start, bs;
    if (!PyArg_ParseTuple(args, "O!O!O!nnOOO", &PyDict_Type, &blocks, &PyList_Type, &path,
                          &PyList_Type, &parents, &start, &bs, &win, &body, &one))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(path);
    if (n == 0 || PyList_GET_SIZE(parents) != n) {
        PyErr_SetString(PyExc_ValueError, "path and parents: the same, non-zero length");
        return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL) return NULL;
    PyObject *rec = NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *lo = PyLong_FromSsize_t(start + k * bs);
        PyObject *hi = PyLong_FromSsize_t(start + (k + 1) * bs);
        rec = PyList_New(7);
        if (lo == NULL || hi == NULL || rec == NULL) {
            Py_XDECREF(lo); Py_XDECREF(hi); Py_XDECREF(rec); Py_DECREF(empty);
            return NULL;
        }
        PyObject *parent = PyList_GET_ITEM(parents, k);
        PyList_SET_ITEM(rec, 0, Py_NewRef(parent));
        PyList_SET_ITEM(rec, 1, lo);
        PyList_SET_ITEM(rec, 2, hi);
        PyList_SET_ITEM(rec, 3, Py_NewRef(win));
        PyList_SET_ITEM(rec, 4, Py_NewRef(body));
        PyList_SET_ITEM(rec, 5, Py_NewRef(one));
        PyList_SET_ITEM(rec, 6, Py_NewRef(empty));
        int failed = PyDict_SetItem(blocks, PyList_GET_ITEM(path, k), rec);
        if (failed || k + 1 < n) Py_DECREF(rec); /* the dict holds it; the last is returned */
        if (failed) { Py_DECREF(empty); return NULL; }
    }
    Py_DECREF(empty);
    return rec;
}

static PyMethodDef METHODS[] = {
    {"decode_batch", decode_batch, METH_VARARGS,
     "decode_batch(payload, stored_cls) -> (ts, events) | None; see vllm_wire.py"},
    {"new_records", new_records, METH_VARARGS,
     "new_records(blocks, path, parents, start, block_size, window, body, one) -> last record"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_ingest_c",
    "vLLM KV event ingest: its hot loops in C (see vllm_wire.py, vllm_blocks.py).", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ingest_c(void) {
    for (int f = 0; f < F_COUNT; f++) {
        FIELD_STRS[f] = PyUnicode_InternFromString(FIELD_NAMES[f]);
        if (FIELD_STRS[f] == NULL) return NULL;
    }
    TOKEN_DATA = PyUnicode_InternFromString("token_data");
    if (TOKEN_DATA == NULL) return NULL;
    return PyModule_Create(&MODULE);
}
