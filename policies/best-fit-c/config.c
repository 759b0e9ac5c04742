#include "config.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p, *end;
    int depth;
} reader_t;

static void skip_ws(reader_t *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static bool literal(reader_t *r, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) return false;
    r->p += n;
    return true;
}

// A string; on success *start/*len give its raw contents (escapes kept).
static bool string(reader_t *r, const char **start, size_t *len) {
    if (r->p >= r->end || *r->p != '"') return false;
    const char *s = ++r->p;
    while (r->p < r->end && *r->p != '"') {
        if ((unsigned char)*r->p < 0x20) return false;
        if (*r->p == '\\') r->p++;
        r->p++;
    }
    if (r->p >= r->end) return false;
    *start = s;
    *len = (size_t)(r->p - s);
    r->p++;
    return true;
}

static bool number(reader_t *r, double *out) {
    const char *s = r->p;
    if (r->p < r->end && *r->p == '-') r->p++;
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return false;
    while (r->p < r->end && ((*r->p >= '0' && *r->p <= '9') || *r->p == '.' || *r->p == 'e' || *r->p == 'E' || *r->p == '+' || *r->p == '-')) r->p++;
    char buf[64];
    size_t n = (size_t)(r->p - s);
    if (n >= sizeof buf) return false;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *stop;
    *out = strtod(buf, &stop);
    return stop == buf + n;
}

static bool value(reader_t *r, double *num, bool *is_num);

static bool container(reader_t *r, char close, bool keyed) {
    if (++r->depth > 64) return false;
    r->p++;
    skip_ws(r);
    if (r->p < r->end && *r->p == close) {
        r->p++;
        r->depth--;
        return true;
    }
    for (;;) {
        skip_ws(r);
        if (keyed) {
            const char *k;
            size_t kl;
            if (!string(r, &k, &kl)) return false;
            skip_ws(r);
            if (r->p >= r->end || *r->p++ != ':') return false;
            skip_ws(r);
        }
        double d;
        bool is_num;
        if (!value(r, &d, &is_num)) return false;
        skip_ws(r);
        if (r->p < r->end && *r->p == ',') {
            r->p++;
            continue;
        }
        if (r->p < r->end && *r->p == close) {
            r->p++;
            r->depth--;
            return true;
        }
        return false;
    }
}

static bool value(reader_t *r, double *num, bool *is_num) {
    *is_num = false;
    if (r->p >= r->end) return false;
    switch (*r->p) {
    case '{': return container(r, '}', true);
    case '[': return container(r, ']', false);
    case '"': {
        const char *s;
        size_t l;
        return string(r, &s, &l);
    }
    case 't': return literal(r, "true");
    case 'f': return literal(r, "false");
    case 'n': return literal(r, "null");
    default: *is_num = true; return number(r, num);
    }
}

const char *config_read(const char *text, size_t len, config_field_t *fields, size_t n_fields) {
    reader_t r = {text, text + len, 0};
    skip_ws(&r);
    if (r.p >= r.end || *r.p != '{') return "expected a JSON object";
    r.p++;
    skip_ws(&r);
    bool empty = r.p < r.end && *r.p == '}';
    if (empty) r.p++;
    while (!empty) {
        skip_ws(&r);
        const char *k;
        size_t kl;
        if (!string(&r, &k, &kl)) return "expected a key";
        skip_ws(&r);
        if (r.p >= r.end || *r.p++ != ':') return "expected ':'";
        skip_ws(&r);
        double d;
        bool is_num;
        if (!value(&r, &d, &is_num)) return "malformed value";
        for (size_t i = 0; i < n_fields; i++) {
            if (strlen(fields[i].key) == kl && memcmp(fields[i].key, k, kl) == 0) {
                if (!is_num) return "a known key is not a number";
                *fields[i].value = d;
            }
        }
        skip_ws(&r);
        if (r.p < r.end && *r.p == ',') {
            r.p++;
            continue;
        }
        if (r.p < r.end && *r.p == '}') {
            r.p++;
            break;
        }
        return "expected ',' or '}'";
    }
    skip_ws(&r);
    return r.p == r.end ? NULL : "trailing text after the object";
}
