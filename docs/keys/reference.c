/*
 * Reference implementation of kvtier's chunk keys (docs/keys/spec.md, spec 3) in C,
 * independent of the Python code: tests/integration/test_keys_elsewhere.py compiles it and checks it against
 * docs/keys/vectors.json. SHA-256 (FIPS 180-4) is written out below, so it needs no library.
 *
 * Build: cc -O2 -o chunk_keys reference.c
 * Input (stdin):  line 1: chunk_tokens
 *                 line 2: the namespace's canonical bytes, hex-encoded
 *                 line 3: multimodal items: their count, then per item (by offset)
 *                         "offset length identifier" with the identifier's UTF-8 hex-encoded
 *                 line 4: token ids, space-separated (may be empty)
 * Output:         the root key, then one key per full chunk, as lowercase hex, one per line.
 *                 A key is the first 16 bytes of a SHA-256 digest.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char DOMAIN[] = "kvtier/ns/v3\n";
static const char MEDIA_TAG[] = "kvtier/mm/v1\n";
#define KEY_BYTES 16

/* ---- SHA-256, FIPS 180-4 (plain, portable, not constant-time: inputs are not secret) ---- */

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char block[64]) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)block[4 * t] << 24 | (uint32_t)block[4 * t + 1] << 16 |
               (uint32_t)block[4 * t + 2] << 8 | (uint32_t)block[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = ROTR(w[t - 15], 7) ^ ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = ROTR(w[t - 2], 17) ^ ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + K[t] +
                      w[t];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d;
    h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

/* out = SHA-256(data)[:16] */
static void key_hash(unsigned char out[KEY_BYTES], const unsigned char *data, size_t len) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t full = len / 64;
    for (size_t i = 0; i < full; i++) sha256_block(h, data + 64 * i);
    /* padding: 0x80, zeros, then the message length in bits as a 64-bit big-endian integer */
    unsigned char tail[128] = {0};
    size_t rest = len - 64 * full;
    memcpy(tail, data + 64 * full, rest);
    tail[rest] = 0x80;
    size_t tail_len = rest + 1 + 8 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) tail[tail_len - 1 - i] = (unsigned char)(bits >> (8 * i));
    for (size_t i = 0; i < tail_len; i += 64) sha256_block(h, tail + i);
    /* digest is h[0..7] big-endian; a key is its first 16 bytes (h[0..3]) */
    for (int i = 0; i < KEY_BYTES; i++) out[i] = (unsigned char)(h[i / 4] >> (24 - 8 * (i % 4)));
}

/* ---- chunk keys ---- */

static void print_key(const unsigned char key[KEY_BYTES]) {
    for (int i = 0; i < KEY_BYTES; i++) printf("%02x", key[i]);
    printf("\n");
}

int main(void) {
    long chunk_tokens;
    if (scanf("%ld", &chunk_tokens) != 1 || chunk_tokens <= 0) return 2;

    /* namespace canonical bytes, hex-encoded */
    static char hex[1 << 16];
    if (scanf("%65535s", hex) != 1) return 2;
    size_t ns_len = strlen(hex) / 2;
    size_t dom_len = sizeof(DOMAIN) - 1;
    unsigned char *root_input = malloc(dom_len + ns_len);
    if (!root_input) return 3;
    memcpy(root_input, DOMAIN, dom_len);
    for (size_t i = 0; i < ns_len; i++) {
        unsigned int byte;
        if (sscanf(hex + 2 * i, "%2x", &byte) != 1) return 2;
        root_input[dom_len + i] = (unsigned char)byte;
    }
    /* root = SHA-256("kvtier/ns/v3\n" || canonical namespace bytes)[:16] */
    unsigned char prev[KEY_BYTES];
    key_hash(prev, root_input, dom_len + ns_len);
    print_key(prev);

    /* multimodal items: a count, then per item "offset length identifier-as-hex", listed
       by offset (the spec's order) */
    long n_media;
    if (scanf("%ld", &n_media) != 1 || n_media < 0 || n_media > 64) return 2;
    long media_offset[64], media_length[64];
    static unsigned char media_id[64][256];
    size_t media_id_len[64];
    size_t extra_max = sizeof(MEDIA_TAG);
    for (long m = 0; m < n_media; m++) {
        static char id_hex[513];
        if (scanf("%ld %ld %512s", &media_offset[m], &media_length[m], id_hex) != 3) return 2;
        media_id_len[m] = strlen(id_hex) / 2;
        for (size_t i = 0; i < media_id_len[m]; i++) {
            unsigned int byte;
            if (sscanf(id_hex + 2 * i, "%2x", &byte) != 1) return 2;
            media_id[m][i] = (unsigned char)byte;
        }
        extra_max += 64 + media_id_len[m];
    }

    /* chain: key_i = SHA-256(key_{i-1} || u32le tokens of chunk i || media extra of i)[:16] */
    size_t chunk_bytes = KEY_BYTES + 4 * (size_t)chunk_tokens;
    unsigned char *buf = malloc(chunk_bytes + extra_max);
    if (!buf) return 3;
    long filled = 0, chunk = 0;
    unsigned long long token;
    while (scanf("%llu", &token) == 1) {
        if (token > 0xffffffffULL) return 2; /* ids must be in [0, 2^32) */
        unsigned char *p = buf + KEY_BYTES + 4 * filled;
        p[0] = token & 0xff; p[1] = (token >> 8) & 0xff;
        p[2] = (token >> 16) & 0xff; p[3] = (token >> 24) & 0xff;
        if (++filled == chunk_tokens) {
            memcpy(buf, prev, KEY_BYTES);
            /* the items whose placeholders overlap [start, end): none adds nothing */
            size_t len = chunk_bytes;
            long start = chunk * chunk_tokens, end = start + chunk_tokens;
            int tagged = 0;
            for (long m = 0; m < n_media; m++) {
                if (media_offset[m] >= end || media_offset[m] + media_length[m] <= start) continue;
                if (!tagged) {
                    memcpy(buf + len, MEDIA_TAG, sizeof(MEDIA_TAG) - 1);
                    len += sizeof(MEDIA_TAG) - 1;
                    tagged = 1;
                }
                len += (size_t)sprintf((char *)buf + len, "%ld %ld %zu:", media_offset[m],
                                       media_length[m], media_id_len[m]);
                memcpy(buf + len, media_id[m], media_id_len[m]);
                len += media_id_len[m];
                buf[len++] = '\n';
            }
            key_hash(prev, buf, len);
            print_key(prev);
            filled = 0;
            chunk++;
        }
    }
    free(buf);
    free(root_input);
    return 0;
}
