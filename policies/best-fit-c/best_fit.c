// best-fit in C: the node left with the least free CPU and GPU after placing
// the task, both normalised by the largest node spec. The same double
// operations in the same order as policies/best-fit (Rust), so every score
// is bit-identical and replays agree placement for placement.
//
// Bindings come from `wit-bindgen c` (build.sh). Arguments are owned by the
// callee and freed here; returned lists are malloc'd and freed by the
// generated post-return functions after the host has copied them.

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "placement_policy.h"

#define DEFAULT_MAX_CPU_MILLI 128000.0
#define DEFAULT_MAX_GPU_MILLI 8000.0

static double max_cpu_milli = DEFAULT_MAX_CPU_MILLI;
static double max_gpu_milli = DEFAULT_MAX_GPU_MILLI;

static void error(placement_policy_string_t *err, const char *prefix, const char *what) {
    size_t a = strlen(prefix), b = strlen(what);
    char *text = malloc(a + b + 1);
    if (text == NULL) abort();
    memcpy(text, prefix, a);
    memcpy(text + a, what, b + 1);
    err->ptr = (uint8_t *)text;
    err->len = a + b;
}

void exports_berth_policy_policy_info(exports_berth_policy_policy_policy_info_t *ret) {
    placement_policy_string_dup(&ret->name, "best-fit-c");
    placement_policy_string_dup(&ret->version, "1.0.0");
    ret->hooks = BERTH_POLICY_TYPES_HOOKS_SCORE;
}

bool exports_berth_policy_policy_configure(placement_policy_string_t *config, placement_policy_string_t *err) {
    const char *text = (const char *)config->ptr;
    size_t len = config->len, i = 0;
    while (i < len && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r')) i++;
    bool ok = true;
    if (i < len) {
        // A configuration replaces the previous one: absent keys take the
        // defaults, unknown keys are ignored (as the Rust policy's serde).
        double cpu = DEFAULT_MAX_CPU_MILLI, gpu = DEFAULT_MAX_GPU_MILLI;
        config_field_t fields[] = {{"max_cpu_milli", &cpu}, {"max_gpu_milli", &gpu}};
        const char *problem = config_read(text, len, fields, 2);
        if (problem != NULL) {
            error(err, "best-fit-c: bad configuration: ", problem);
            ok = false;
        } else {
            max_cpu_milli = cpu;
            max_gpu_milli = gpu;
        }
    }
    placement_policy_string_free(config);
    return ok;
}

bool exports_berth_policy_policy_score(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_nodes_t *nodes,
                                       exports_berth_policy_policy_scores_t *ret, placement_policy_string_t *err) {
    (void)err;
    size_t n = nodes->ids.len;
    double *scores = malloc((n ? n : 1) * sizeof(double));
    if (scores == NULL) abort();
    const double req_cpu = (double)task->cpu_milli;
    const double req_gpu = (double)((uint64_t)task->gpu_count * (uint64_t)task->gpu_milli);
    const uint32_t *cpu_free = nodes->cpu_free_milli.ptr, *start = nodes->gpu_start.ptr, *count = nodes->gpu_count.ptr,
                   *gpu_free = nodes->gpu_free_milli.ptr;
    for (size_t i = 0; i < n; i++) {
        uint32_t free_total = 0;
        for (uint32_t g = start[i]; g < start[i] + count[i]; g++) free_total += gpu_free[g];
        double left = ((double)cpu_free[i] - req_cpu) / max_cpu_milli * 0.5 + ((double)free_total - req_gpu) / max_gpu_milli * 0.5;
        scores[i] = trunc((1.0 - left) * 100.0);
    }
    ret->scores.ptr = scores;
    ret->scores.len = n;
    ret->gpus.ptr = NULL; // the host chooses GPUs on every node
    ret->gpus.len = 0;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_nodes_free(nodes);
    return true;
}

// Hooks best-fit does not claim: the host never calls them.
bool exports_berth_policy_policy_score_domains(exports_berth_policy_policy_task_t *task, exports_berth_policy_policy_domains_t *domains,
                                               placement_policy_list_f64_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(task);
    exports_berth_policy_policy_domains_free(domains);
    error(err, "best-fit-c does not score domains", "");
    return false;
}

bool exports_berth_policy_policy_compact(exports_berth_policy_policy_snapshot_t *snapshot, exports_berth_policy_policy_plan_t *ret,
                                         placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_snapshot_free(snapshot);
    error(err, "best-fit-c does not compact", "");
    return false;
}

bool exports_berth_policy_policy_rank(exports_berth_policy_policy_task_t *demand, exports_berth_policy_policy_allocations_t *victims,
                                      placement_policy_list_u32_t *ret, placement_policy_string_t *err) {
    (void)ret;
    exports_berth_policy_policy_task_free(demand);
    exports_berth_policy_policy_allocations_free(victims);
    error(err, "best-fit-c does not rank", "");
    return false;
}
