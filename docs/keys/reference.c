/*
 * Reference implementation of kvtier's chunk keys (docs/keys/spec.md) in C, independent of
 * the Python code: tests/test_keys.py compiles it and checks it against docs/keys/vectors.json.
 *
 * Build: cc -O2 -o chunk_keys reference.c -lxxhash     (Debian: libxxhash-dev)
 * Input (stdin):  line 1: chunk_tokens
 *                 line 2: the namespace's canonical bytes, hex-encoded
 *                 line 3: token ids, space-separated (may be empty)
 * Output:         the root key, then one key per full chunk, as lowercase hex, one per line.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static const char DOMAIN[] = "kvtier/ns/v2\n";

static void print_key(const XXH128_canonical_t *key) {
    for (int i = 0; i < 16; i++) printf("%02x", key->digest[i]);
    printf("\n");
}

int main(void) {
    long chunk_tokens;
    if (scanf("%ld", &chunk_tokens) != 1 || chunk_tokens <= 0) return 2;

    /* namespace canonical bytes, hex-encoded */
    char hex[1 << 16];
    if (scanf("%65535s", hex) != 1) return 2;
    size_t ns_len = strlen(hex) / 2;
    size_t dom_len = sizeof(DOMAIN) - 1;
    unsigned char *root_input = malloc(dom_len + ns_len);
    memcpy(root_input, DOMAIN, dom_len);
    for (size_t i = 0; i < ns_len; i++) {
        unsigned int byte;
        sscanf(hex + 2 * i, "%2x", &byte);
        root_input[dom_len + i] = (unsigned char)byte;
    }
    XXH128_canonical_t prev;
    XXH128_canonicalFromHash(&prev, XXH3_128bits(root_input, dom_len + ns_len));
    print_key(&prev);

    /* chain: key_i = XXH3-128(key_{i-1} || u32le tokens of chunk i) */
    size_t chunk_bytes = 16 + 4 * (size_t)chunk_tokens;
    unsigned char *buf = malloc(chunk_bytes);
    long filled = 0;
    unsigned long long token;
    while (scanf("%llu", &token) == 1) {
        unsigned char *p = buf + 16 + 4 * filled;
        p[0] = token & 0xff; p[1] = (token >> 8) & 0xff;
        p[2] = (token >> 16) & 0xff; p[3] = (token >> 24) & 0xff;
        if (++filled == chunk_tokens) {
            memcpy(buf, prev.digest, 16);
            XXH128_canonicalFromHash(&prev, XXH3_128bits(buf, chunk_bytes));
            print_key(&prev);
            filled = 0;
        }
    }
    free(buf);
    free(root_input);
    return 0;
}
