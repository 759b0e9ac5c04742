// {{name}}: a Berth preemption-ranking policy. When high-priority work
// needs room, the host offers the running allocations it may evict and
// evicts in the order returned until the work fits. This one evicts the
// work with the least to recompute first (SpotGPU): GPUs held x seconds
// since the last checkpoint, summed over a job's allocations; lower
// priority always goes first, the job id breaks ties.
//
// Bindings come from `wit-bindgen c` (build.sh). Arguments are owned by the
// callee: free them. Returned lists must be malloc'd: the generated
// post-return code frees them once the host has copied them.

#include <stdlib.h>

#include "placement_policy.h"

void exports_berth_policy_policy_info(exports_berth_policy_policy_policy_info_t *ret) {
    placement_policy_string_dup(&ret->name, "{{name}}");
    placement_policy_string_dup(&ret->version, "0.1.0");
    // The host calls only the hooks claimed here (build.sh leaves their
    // stubs out of unclaimed.c).
    ret->hooks = BERTH_POLICY_TYPES_HOOKS_RANK;
}

bool exports_berth_policy_policy_configure(placement_policy_string_t *config, placement_policy_string_t *err) {
    // TOML or JSON text from the operator; empty for defaults. To reject it,
    // set *err (placement_policy_string_dup) and return false.
    (void)err;
    placement_policy_string_free(config);
    return true;
}

typedef struct {
    uint64_t id;
    uint32_t priority;
    double lost;  // GPU-seconds since the last checkpoint
} job_t;

// Lowest priority first, then least work lost, then job id.
static int before(const job_t *a, const job_t *b) {
    if (a->priority != b->priority) return a->priority < b->priority;
    if (a->lost != b->lost) return a->lost < b->lost;
    return a->id < b->id;
}

bool exports_berth_policy_policy_rank(exports_berth_policy_policy_task_t *demand, exports_berth_policy_policy_allocations_t *v,
                                      placement_policy_list_u32_t *ret, placement_policy_string_t *err) {
    (void)err;
    size_t n = v->ids.len, jobs = 0;
    job_t *job = calloc(n ? n : 1, sizeof(job_t));
    size_t *job_of = calloc(n ? n : 1, sizeof(size_t));
    uint32_t *order = malloc((n ? n : 1) * sizeof(uint32_t));
    if (job == NULL || job_of == NULL || order == NULL) abort();
    // A job (a gang) is evicted whole: group its allocations.
    for (size_t i = 0; i < n; i++) {
        size_t j = 0;
        while (j < jobs && job[j].id != v->job_ids.ptr[i]) j++;
        if (j == jobs) job[jobs++] = (job_t){v->job_ids.ptr[i], v->priority.ptr[i], 0.0};
        double gpus = (double)__builtin_popcountll(v->gpus.ptr[i]) * (double)v->gpu_milli.ptr[i] / 1000.0;
        job[j].lost += gpus * (double)v->since_checkpoint_s.ptr[i];
        job_of[i] = j;
    }
    // Rank the jobs (insertion sort of their indexes), then list every
    // member of each, job after job: every victim index once.
    size_t *rank = malloc((jobs ? jobs : 1) * sizeof(size_t));
    if (rank == NULL) abort();
    for (size_t j = 0; j < jobs; j++) {
        size_t k = j;
        while (k > 0 && before(&job[j], &job[rank[k - 1]])) {
            rank[k] = rank[k - 1];
            k--;
        }
        rank[k] = j;
    }
    size_t out = 0;
    for (size_t r = 0; r < jobs; r++) {
        for (size_t i = 0; i < n; i++) {
            if (job_of[i] == rank[r]) order[out++] = (uint32_t)i;
        }
    }
    ret->ptr = order;
    ret->len = out;
    free(job);
    free(job_of);
    free(rank);
    exports_berth_policy_policy_task_free(demand);
    exports_berth_policy_policy_allocations_free(v);
    return true;
}
