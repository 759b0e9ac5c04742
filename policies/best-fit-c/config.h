// A small JSON reader for best-fit's configuration: checks that the text is
// one JSON object and reads the numbers at its top level that the policy
// knows. No allocation, no libc I/O (the component imports nothing).
#ifndef BEST_FIT_CONFIG_H
#define BEST_FIT_CONFIG_H
#include <stddef.h>

typedef struct {
    const char *key;  // top-level key to read
    double *value;    // set when the key is present
} config_field_t;

// Returns NULL on success, else a static message naming the problem.
const char *config_read(const char *text, size_t len, config_field_t *fields, size_t n_fields);

#endif
